"""Multi-LoRA serving: PEFT adapters read from storage (`peft`), kept in an LRU between host memory
and a fixed number of device slots (`registry`), stacked on the device for the model's batched
deltas (`stack`, serving.models.lora). `errors` imports nothing else: the fronts use it."""
