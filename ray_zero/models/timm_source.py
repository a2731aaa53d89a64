"""`timm:NAME`: a timm image classifier (random weights, nothing downloaded), model_config as
timm.create_model's keyword arguments, trained on random images of its input size with uniform labels.
torch and timm only."""

from __future__ import annotations

from ray_zero.models.source import Built, ModelError, classifier, did_you_mean, one_line, refuse


def build_timm(name: str, config: dict, seq_len, input_shape, num_classes) -> Built:
    try:
        import timm
    except ImportError as error:
        raise ModelError(
            f"timm: models need the timm package, which did not import ({one_line(error)}); "
            "pip install -r requirements.txt"
        ) from None

    source = f"timm:{name}"
    refuse(source, "seq_len is for token models", seq_len=seq_len)
    if not timm.is_model(name):
        raise ModelError(
            f"unknown timm model {name!r}{did_you_mean(name, timm.list_models())}"
            "; allowed: timm.list_models()"
        )
    if num_classes is not None:
        config.setdefault("num_classes", num_classes)
    try:
        module = timm.create_model(name, pretrained=False, **config)
    except Exception as error:
        raise ModelError(f"building {source} with model_config {config} failed: {one_line(error)}") from None
    if not module.num_classes:  # a feature extractor (SAM's, DINOv2's encoders): no labels to train on
        raise ModelError(
            f"{source} has no classifier head (it is built with 0 classes); set num_classes, e.g. "
            "--set num_classes=1000"
        )
    channels, height, width = module.pretrained_cfg["input_size"]
    size = config.get("img_size")  # the default size is the pretrained one, which img_size overrides
    if size is not None:
        height, width = (size, size) if isinstance(size, int) else size
    shape = tuple(input_shape or (config.get("in_chans", channels), height, width))
    return classifier(
        module, shape, module.num_classes, "timm", enable=lambda model: model.set_grad_checkpointing(True)
    )
