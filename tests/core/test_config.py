import pytest

from ktm.core.config import KTMConfig, LoraSettings
from ktm.core.prompt import Segment
from ktm.decode.generate import GenerationConfig
from ktm.errors import KTMError
from ktm.training.config import TrainConfig
from ktm.training.pretrain import PretrainConfig


@pytest.mark.parametrize("kw,match", [
    ({"k": 0}, "k must be an integer >= 1, got 0"),
    ({"k": True}, "k must be an integer"),
    ({"mlp_ratio": 0.0}, "mlp_ratio must be > 0"),
    ({"use_mlp": False, "mlp_gate": True}, "mlp_gate=True needs use_mlp=True"),
    ({"plain_prefix": -1}, "plain_prefix must be an integer >= 0"),
    ({"plain_suffix": 1.5}, "plain_suffix must be an integer >= 0, got 1.5"),
    ({"dtype": "int8"}, "dtype must be one of"),
    ({"lora": {"r": 0}}, "LoRA r must be an integer >= 1, got 0"),
    ({"lora": {"dropout": 1.0}}, r"LoRA dropout must be in \[0, 1\)"),
    ({"lora": {"target_modules": ()}}, "LoRA target_modules must be non-empty"),
])
def test_bad_values_are_refused_on_construction(kw, match):
    with pytest.raises(KTMError, match=match):
        KTMConfig(**kw)


def test_round_trip_and_canonical_dtype():
    cfg = KTMConfig(k=3, dtype="bf16", lora=LoraSettings(r=8, target_modules=("q_proj",)))
    assert cfg.dtype == "bfloat16"
    again = KTMConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.lora.target_modules == ("q_proj",)


def test_unknown_fields_are_refused():
    with pytest.raises(KTMError, match=r"unknown fields \['kk'\]"):
        KTMConfig.from_dict({"kk": 2})


def test_format_1_config_is_read_with_later_fields_off():
    cfg = KTMConfig.from_checkpoint({
        "base_model": "m", "encoder": {"hidden_size": 64, "k": 2, "mlp_ratio": 1.0,
                                       "use_mlp": True},
        "lora": {"r": 4, "alpha": 16, "dropout": 0.05, "target_modules": ["q_proj"]},
        "add_eos": False})
    assert (cfg.k, cfg.mlp_ratio, cfg.slot_weights, cfg.mlp_gate, cfg.add_eos) == (
        2, 1.0, False, False, False)


@pytest.mark.parametrize("kw,match", [
    ({"lr": float("nan")}, "lr must be a finite number, got nan"),
    ({"encoder_lr": float("inf")}, "encoder_lr must be a finite number"),
    ({"slot_lr": float("nan")}, "slot_lr must be a finite number"),
    ({"clip_norm": float("nan")}, "clip_norm must be a finite number"),
    ({"weight_decay": float("nan")}, "weight_decay must be a finite number"),
    ({"weight_decay": -0.1}, "weight_decay must be >= 0"),  # AdamW's own ValueError before
])
def test_train_config_refuses_rates_that_are_not_finite(kw, match):
    from ktm.training.config import TrainConfig

    with pytest.raises(KTMError, match=match):
        TrainConfig(**kw)
    TrainConfig(clip_norm=0.0, weight_decay=0.0)  # clipping off, no decay: fine


@pytest.mark.parametrize("make, field", [
    (lambda: KTMConfig(use_mlp="no"), "use_mlp"),  # truthy: silently meant True
    (lambda: KTMConfig(add_eos=None), "add_eos"),
    (lambda: KTMConfig(mlp_ratio="2"), "mlp_ratio"),
    (lambda: KTMConfig(base_model=5), "base_model"),
    (lambda: KTMConfig(lora=5), "lora"),
    (lambda: KTMConfig(lora={"rr": 3}), "lora"),
    (lambda: LoraSettings(alpha="x"), "alpha"),
    (lambda: LoraSettings(dropout=None), "dropout"),
    (lambda: TrainConfig(lr="1e-4"), "lr"),
    (lambda: TrainConfig(max_steps=1.5), "max_steps"),
    (lambda: TrainConfig(resume="no"), "resume"),
    (lambda: TrainConfig(out_dir=""), "out_dir"),
    (lambda: GenerationConfig(do_sample="no"), "do_sample"),
    (lambda: GenerationConfig(seed="x"), "seed"),
    (lambda: PretrainConfig(context_tokens="256"), "context_tokens"),
    (lambda: Segment("x", compress="no"), "compress"),
])
def test_wrong_field_types_are_refused_naming_the_field(make, field):
    with pytest.raises(KTMError, match=field):
        make()


def test_lora_target_modules_not_names_is_a_clear_error():
    with pytest.raises(KTMError, match="LoRA target_modules must be module names, got 5"):
        LoraSettings(target_modules=5)
