"""What a model is to ray_zero, whatever its source: presets, `hf:TYPE`, `timm:NAME` or a user's factory,
described on the meta device (describe.ModelInfo) and built for a rank (spec.ModelSpec). torch only: no
Ray, no DeepSpeed; Transformers and timm are imported only for their sources. Nothing is imported here:
presets.py (the presets' shapes) stays free of torch for the tables and the memory model."""
