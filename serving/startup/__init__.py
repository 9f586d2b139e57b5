"""Start-up's resolution, read top to bottom: `profile` (the config the command line gives, and
where each key came from; no JAX), `slots` (the serving profile's slots sized to the memory and
the model), `plan` (the one frozen LaunchPlan that placement, restore, the engine and the kernels
read; serving.launch executes it)."""
