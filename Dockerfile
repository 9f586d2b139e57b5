# The pathserve engine image: `pathserve serve` (or `pathserve batch`) on TPUs through Pathways.
# Its tag carries the jax version, like the Pathways images it runs beside:
#   docker build --build-arg JAX_VERSION=0.10.2 -t REGISTRY/pathserve:jax-0.10.2 .
# configs/deployments/*.yml name this image under images.engine.
FROM python:3.12-slim

ARG JAX_VERSION=0.10.2
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PATHSERVE_CONFIG_DIR=/opt/pathserve/configs

WORKDIR /opt/pathserve
# JAX for TPU (libtpu comes from PyPI) and the Pathways client, pinned to the image tag's version.
RUN pip install "jax[tpu]==${JAX_VERSION}" pathwaysutils

COPY pyproject.toml README.md ./
COPY serving serving
COPY loadtest loadtest
COPY configs configs
RUN pip install '.[gcs]' && pathserve --help > /dev/null

EXPOSE 8000
ENTRYPOINT ["pathserve"]
# In a container the server must listen beyond loopback; the manifests pass their own arguments.
CMD ["serve", "--host=0.0.0.0"]
