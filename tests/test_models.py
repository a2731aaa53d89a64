"""Model sources on real models, CPU: presets, hf: (GPT-2, Llama, ViT), timm:, the example factories.

Each source builds, trains a few steps, is counted on the meta device like the real module, checkpoints
to the same gradients with fewer saved bytes; FLOPs come from FlopCounterMode; bad input is one line.
"""
from __future__ import annotations

import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ray_zero.model_spec import ModelSpec
from ray_zero.models import ModelError, build_model_spec, describe_model, find_blocks
from ray_zero.sizes import PRESETS

REPO = Path(__file__).resolve().parents[1]

TINY_GPT2 = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128, bos_token_id=0,
                 eos_token_id=0, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
TINY_LLAMA = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1000, bos_token_id=0, eos_token_id=0)
TINY_VIT = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, image_size=32,
                patch_size=8, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

# (model, model_config, seq_len, input_shape, num_classes), one per source, all small.
SOURCES = {
    "seed": ("seed", None, None, None, None),
    "gpt2": ("hf:gpt2", TINY_GPT2, 64, None, None),
    "llama": ("hf:llama", TINY_LLAMA, 64, None, None),
    "hf-vit": ("hf:vit", TINY_VIT, None, None, None),
    "timm": ("timm:test_vit", None, None, None, None),
    "spec-factory": ("examples/my_model.py:build", {"width": 64}, None, None, None),
    "module-factory": ("examples.my_model:build_classifier", None, None, [3, 16, 16], 10),
}


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # factories' paths are read from the working directory


def _spec(name: str) -> ModelSpec:
    torch.manual_seed(0)
    return build_model_spec(*SOURCES[name])


def _batch(spec: ModelSpec, n: int = 4, seed: int = 1):
    return spec.make_batch(n, torch.device("cpu"), torch.Generator().manual_seed(seed))


def _first(spec: ModelSpec, seed: int) -> torch.Tensor:
    batch = _batch(spec, seed=seed)
    return batch[0] if isinstance(batch, tuple) else batch


@pytest.mark.parametrize("name", SOURCES)
def test_each_source_builds_trains_and_is_counted_like_the_real_module(name):
    spec = _spec(name)
    batch = _batch(spec)
    first = batch[0] if isinstance(batch, tuple) else batch
    assert first.shape[0] == 4 and first.device.type == "cpu"
    # The batch comes from the generator it is given: the same seed, the same batch; another, another.
    assert torch.equal(_batch(spec)[0], batch[0]) and not torch.equal(_first(spec, seed=7), first)
    optimizer = torch.optim.AdamW(spec.module.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss = spec.loss(spec.module, batch)
        assert loss.dim() == 0 and loss.dtype == torch.float32 and torch.isfinite(loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    info = describe_model(*SOURCES[name])
    assert info.params == sum(p.numel() for p in spec.module.parameters()) > 0
    assert info.param_bytes == 4 * info.params  # built in fp32
    assert info.flops_per_sample > 0 and "\n" not in info.description
    assert spec.blocks and spec.enable_checkpointing is not None


@pytest.mark.parametrize("name", ["seed", "gpt2", "llama", "hf-vit", "timm", "spec-factory", "module-factory"])
def test_checkpointing_gives_the_same_gradients_and_saves_fewer_bytes(name):
    results = []
    for checkpointed in (False, True):
        spec = _spec(name)
        if checkpointed:
            spec.enable_checkpointing(spec.module)
        torch.manual_seed(2)  # the same dropout masks in both runs (checkpointing replays the RNG)
        results.append(_saved_bytes_and_grads(spec))
    (plain_bytes, plain_grads), (ckpt_bytes, ckpt_grads) = results
    assert ckpt_bytes < plain_bytes
    for plain, ckpt in zip(plain_grads, ckpt_grads):
        torch.testing.assert_close(ckpt, plain, rtol=1e-4, atol=1e-6)


def _saved_bytes_and_grads(spec: ModelSpec):
    storages = {}

    def pack(tensor):  # each storage once: views and repeats of one tensor cost nothing more
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    batch = _batch(spec)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = spec.loss(spec.module, batch)
    loss.backward()
    return sum(storages.values()), [p.grad.clone() for p in spec.module.parameters()]


def test_gpt2_default_is_124m_parameters_counted_fast_and_offline():
    start = time.perf_counter()
    info = describe_model("hf:gpt2")
    assert time.perf_counter() - start < 20  # about 1-5 s here, most of it importing transformers
    assert info.params == 124_439_808 and info.kind == "hf" and info.task == "causal-lm"
    assert info.seq_len == 1024 == info.max_positions  # default: min(1024, the model's positions)
    assert info.description == "GPT2LMHeadModel (hf:gpt2), 124,439,808 parameters, seq_len 1024"


def test_gpt2_flops_grow_faster_than_seq_len_because_attention_is_counted():
    short, long = (describe_model("hf:gpt2", seq_len=n).flops_per_sample for n in (512, 1024))
    assert long > 2.05 * short  # only the quadratic attention term makes it more than double


@pytest.mark.parametrize("preset", ["seed", "large"])
def test_preset_flops_counted_agree_with_the_shape_formula(preset):
    info = describe_model(preset)
    assert info.params == PRESETS[preset].param_count()
    assert info.flops_per_sample == pytest.approx(PRESETS[preset].flops_per_sample(), rel=0.05)


def test_presets_keep_their_parameter_counts_and_info_is_plain_data():
    assert describe_model("seed").params == 274_698
    info = describe_model("large")
    assert info.params == 805_888_010 and info.param_bytes == 4 * 805_888_010
    assert pickle.loads(pickle.dumps(info)) == info


def test_timm_kwargs_reach_the_model_and_its_input_size():
    info = describe_model("timm:test_vit", {"img_size": 64, "num_classes": 7})
    assert info.description.endswith("input 3x64x64, 7 classes")
    assert info.flops_per_sample < describe_model("timm:test_vit").flops_per_sample


def test_blocks_are_the_repeated_layers():
    assert [type(b).__name__ for b in _spec("gpt2").blocks] == ["GPT2Block"] * 2
    assert [type(b).__name__ for b in _spec("llama").blocks] == ["LlamaDecoderLayer"] * 2
    assert [type(b).__name__ for b in _spec("module-factory").blocks] == ["ConvBlock"] * 3
    assert [type(b).__name__ for b in _spec("timm").blocks] == ["Block"] * len(_spec("timm").module.blocks)
    with torch.device("meta"):  # a ResNet's blocks sit in four stages: all eight are found
        import timm
        resnet = timm.create_model("resnet18", pretrained=False)
    assert [type(b).__name__ for b in find_blocks(resnet)] == ["BasicBlock"] * 8
    assert find_blocks(torch.nn.Linear(2, 2)) is None


def test_preset_and_factory_sources_import_neither_transformers_nor_timm():
    code = ("import sys; from ray_zero.models import describe_model; describe_model('seed'); "
            "describe_model('examples/my_model.py:build'); "
            "print([m for m in ('transformers', 'timm', 'ray', 'deepspeed') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


BAD_INPUTS = [
    (dict(model="hf:gpt3"), "unknown hf model type 'gpt3' (did you mean"),
    (dict(model="hf:gpt2", model_config={"n_layers": 2}), "unknown model_config key 'n_layers' for hf:gpt2 (did you mean 'n_layer'"),
    (dict(model="hf:t5"), "neither a causal LM nor an image classifier"),
    (dict(model="hf:gpt2", seq_len=2048), "seq_len 2048 exceeds hf:gpt2's maximum positions 1024"),
    (dict(model="hf:gpt2", model_config={"n_layer": "two"}), "building hf:gpt2 with model_config"),
    (dict(model="timm:vit_tiny_patch16_2244"), "unknown timm model 'vit_tiny_patch16_2244' (did you mean 'vit_tiny_patch16_224'"),
    (dict(model="timm:test_vit", model_config={"depthh": 2}), "building timm:test_vit with model_config {'depthh': 2} failed: TypeError"),
    (dict(model="seed", model_config={"dim": 64}), "preset 'seed' takes no model_config"),
    (dict(model="seed", seq_len=128), "seq_len 128 not used by seed"),
    (dict(model="hf gpt2"), "malformed model 'hf gpt2'; allowed: a preset (seed | base | large), hf:TYPE"),
    (dict(model="examples/missing.py:build"), "factory file 'examples/missing.py' not found"),
    (dict(model="no_such_package.models:build"), "factory module 'no_such_package.models' not found"),
    (dict(model="examples/my_model.py:bild"), "factory function 'bild' not found in 'examples/my_model.py' (did you mean 'build'"),
    (dict(model="examples/my_model.py:build", model_config={"widht": 8}), "factory examples/my_model.py:build raised TypeError"),
    (dict(model="examples/my_model.py:build_classifier"), "returned a plain nn.Module: give input_shape"),
    (dict(model="examples/my_model.py:build", num_classes=10), "num_classes 10 not used by examples/my_model.py:build"),
    (dict(model="json:dumps"), "factory json:dumps raised TypeError"),
    (dict(model="math:pi"), "factory function 'pi' not found in 'math'"),
    (dict(model="json:loads", model_config={"s": "1"}), "factory json:loads returned int, not an nn.Module or a ModelSpec"),
]


@pytest.mark.parametrize("call, phrase", BAD_INPUTS, ids=[phrase[:40] for _, phrase in BAD_INPUTS])
@pytest.mark.parametrize("function", [describe_model, build_model_spec])
def test_bad_input_is_one_line_naming_the_problem(function, call, phrase):
    with pytest.raises(ModelError) as raised:
        function(**call)
    message = str(raised.value)
    assert phrase in message and "\n" not in message


def test_a_factory_whose_import_fails_says_so(tmp_path, monkeypatch):
    (tmp_path / "broken.py").write_text("import torch\nraise RuntimeError('no GPU in this file')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match=r"importing factory file 'broken.py' failed: RuntimeError: no GPU"):
        describe_model("broken.py:build")
