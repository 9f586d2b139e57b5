"""Print this interpreter's version and those of the packages that wrote the fixtures."""

import contextlib
import importlib.metadata as metadata
import sys

PACKAGES = (
    "maxtext",
    "jax",
    "jaxlib",
    "flax",
    "orbax-checkpoint",
    "aqtp",
    "google-jetstream",
    "torch",
    "transformers",
    "safetensors",
    "numpy",
)

print(f"{sys.prefix.rsplit('/', 1)[-1]}: python {sys.version.split()[0]}")
for name in PACKAGES:
    with contextlib.suppress(metadata.PackageNotFoundError):
        print(f"  {name}=={metadata.version(name)}")
