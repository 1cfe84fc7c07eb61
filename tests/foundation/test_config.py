"""Config: round trip, typed overrides, unknown keys with suggestions, wrong types named."""

from __future__ import annotations

import pytest
import yaml

from posttrain.config import ConfigError, RunConfig, apply_overrides, config_to_yaml, load_config


def test_defaults_round_trip_through_yaml(tmp_path):
    cfg = load_config()
    path = tmp_path / "c.yaml"
    path.write_text(config_to_yaml(cfg))
    assert load_config(path) == cfg


def test_overrides_of_every_type(tmp_path):
    cfg = load_config(
        None,
        [
            "seed=7",
            "trainer.lr=1e-5",
            "trainer.packing=false",
            "model.spec=tiny:llama",
            "envs.domains.0.difficulties=[1, 2]",
            "trainer.betas=[0.8, 0.95]",
            "algorithm.dual_clip=3.0",
        ],
    )
    assert cfg.seed == 7 and isinstance(cfg.seed, int)
    assert cfg.trainer.lr == pytest.approx(1e-5)
    assert cfg.trainer.packing is False
    assert cfg.model.spec == "tiny:llama"
    assert cfg.envs.domains[0].difficulties == [1, 2]
    assert cfg.trainer.betas == (0.8, 0.95)
    assert cfg.algorithm.dual_clip == 3.0


def test_overrides_apply_on_top_of_a_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"seed": 3, "trainer": {"lr": 0.5}}))
    cfg = load_config(path, ["trainer.lr=0.25"])
    assert cfg.seed == 3 and cfg.trainer.lr == 0.25
    assert cfg.trainer.max_grad_norm == RunConfig().trainer.max_grad_norm


def test_unknown_key_names_path_and_suggests():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.lrr=1"])
    msg = str(err.value)
    assert "unknown key 'trainer.lrr'" in msg and "did you mean 'trainer.lr'" in msg


def test_unknown_top_level_section_suggests(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainr:\n  lr: 1.0\n")
    with pytest.raises(ConfigError, match="unknown key 'trainr'; did you mean 'trainer'"):
        load_config(path)


def test_wrong_type_names_key_value_and_type():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["orchestrator.steps=many"])
    msg = str(err.value)
    assert "'orchestrator.steps'" in msg and '"many"' in msg and "integer" in msg


def test_constraint_violation_is_named():
    with pytest.raises(ConfigError, match="'curriculum.eps'.*1.5"):
        load_config(None, ["curriculum.eps=1.5"])


def test_malformed_override_and_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_config(None, ["trainer.lr"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(bad)


def test_gae_without_critic_is_rejected():
    with pytest.raises(ConfigError, match="needs a value function"):
        load_config(None, ["algorithm.advantage=gae"])


def test_apply_overrides_does_not_mutate_input():
    data = {"trainer": {"lr": 1.0}}
    out = apply_overrides(data, ["trainer.lr=2"])
    assert data["trainer"]["lr"] == 1.0 and out["trainer"]["lr"] == 2


@pytest.mark.parametrize(
    "path", sorted(__import__("pathlib").Path(__file__).parents[2].joinpath("configs").glob("*.yaml"))
)
def test_shipped_configs_validate(path):
    load_config(path)


def test_ray_placement_without_shared_file_weights_is_refused_before_work():
    from posttrain.orchestrator.rl import RLRun

    with pytest.raises(ValueError, match="set placement.weight_sync='shared_file'"):
        RLRun.check(load_config(None, ["placement.backend=ray", "model.spec=tiny:llama"]))


def test_engine_dtype_auto_follows_native_bf16_and_learner_autocast_follows_the_engine(monkeypatch):
    import posttrain.config as config_mod

    for native, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(config_mod, "native_bf16", lambda device="cpu", _n=native: _n)
        cfg = load_config(None, [])
        assert cfg.engine.dtype == expected and cfg.trainer.bf16_autocast is (expected == "bfloat16")
        assert config_mod.EngineConfig().resolved_dtype() == expected
    # explicit choices are kept, in both directions
    pinned = load_config(None, ["engine.dtype=float32", "trainer.bf16_autocast=true"])
    assert pinned.engine.dtype == "float32" and pinned.trainer.bf16_autocast is True
    # the resolved value is what a run directory's config.yaml records
    assert load_config(None, []).model_dump()["engine"]["dtype"] in ("float32", "bfloat16")


def test_an_engine_dtype_override_resolves_the_learner_autocast_anew(monkeypatch, tmp_path):
    import posttrain.config as config_mod

    monkeypatch.setattr(config_mod, "native_bf16", lambda device="cpu": True)  # auto would pick bfloat16
    # the override of engine.dtype must not inherit the autocast resolved for the default (it used to: True)
    assert load_config(None, ["engine.dtype=float32"]).trainer.bf16_autocast is False
    assert load_config(None, ["engine.dtype=float32", "seed=3"]).trainer.bf16_autocast is False
    assert load_config(None, ["seed=3"]).trainer.bf16_autocast is True
    monkeypatch.setattr(config_mod, "native_bf16", lambda device="cpu": device == "cuda")
    assert (
        load_config(None, ["engine.device=cuda"]).engine.dtype == "bfloat16"
    )  # auto resolved for the new device
    f = tmp_path / "run.yaml"
    f.write_text("engine: {dtype: float32}\n")
    assert load_config(f, ["engine.dtype=bfloat16"]).trainer.bf16_autocast is True
    f.write_text("engine: {dtype: float32}\ntrainer: {bf16_autocast: true}\n")
    assert load_config(f, ["seed=1"]).trainer.bf16_autocast is True  # a value the file gives is kept


def test_native_bf16_reads_the_cpu_flags(monkeypatch, tmp_path):
    import builtins

    import posttrain.config as config_mod

    real_open = builtins.open
    for flags, expected in (
        ("fpu avx512f avx512_bf16 sse", True),
        ("fpu amx_bf16", True),
        ("fpu avx2 avx512f", False),
    ):
        info = tmp_path / "cpuinfo"
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        monkeypatch.setattr(
            builtins,
            "open",
            lambda p, *a, _i=info, **k: real_open(_i if p == "/proc/cpuinfo" else p, *a, **k),
        )
        assert config_mod.native_bf16("cpu") is expected


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("engine.temperature=0.7", "unknown key 'engine.temperature'; did you mean 'algorithm.temperature'?"),
        ("placement.device=cuda", "unknown key 'placement.device'; did you mean 'engine.device'?"),
        ("placement.num_gpus=8", "unknown key 'placement.num_gpus'; did you mean 'placement.engine_gpus'?"),
        ("placement.num_nodes=2", "unknown key 'placement.num_nodes'; did you mean 'placement.ray_address'?"),
    ],
)
def test_keys_that_did_nothing_are_gone_with_the_unknown_key_error(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert expected in str(err.value)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("algorithm.advantage=grp", "'algorithm.advantage': got \"grp\""),
        ("algorithm.policy_loss=ppo_clp", "did you mean 'ppo_clip'?"),
        ("curriculum.sampler=sec_", "did you mean 'sec'?"),
    ],
)
def test_registered_names_are_checked_when_the_config_loads(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert expected in str(err.value)
    if "advantage" in override:
        assert "did you mean 'grpo'?" in str(err.value) and "registered: " in str(err.value)


@pytest.mark.parametrize("name", ["..", ".", "../x", "a/b", ".hidden", "a..b", "", "x\n", "a b"])
def test_run_names_must_be_one_safe_path_component(name):
    with pytest.raises(ConfigError, match="'telemetry.name'.*is not allowed"):
        load_config(None, [f"telemetry.name={name!r}"] if name else ["telemetry.name=''"])
    assert load_config(None, ["telemetry.name=grpo-math_1.v2"]).telemetry.name == "grpo-math_1.v2"


def test_dr_grpo_constant_follows_max_new_tokens_unless_given():
    base = ["algorithm.loss_agg=seq_mean_token_sum_norm"]
    assert load_config(None, [*base, "engine.max_new_tokens=200"]).algorithm.loss_norm_tokens == 200
    assert load_config(None, [*base, "algorithm.loss_norm_tokens=50"]).algorithm.loss_norm_tokens == 50
    assert load_config(None, []).algorithm.loss_norm_tokens is None  # token_mean: no constant


def test_sandbox_limits_and_domain_weight_are_validated():
    with pytest.raises(ConfigError, match="'envs.domains\\[0\\].weight': got 0"):
        load_config(None, ["envs.domains.0.weight=0"])
    cfg = load_config(None, ["sandbox.wall_time_s=2.5", "sandbox.memory_mb=256"])
    assert (cfg.sandbox.wall_time_s, cfg.sandbox.memory_mb) == (2.5, 256)


MOVED = [
    ("orchestrator.tasks_per_step", "batch.prompts_per_step", 3),
    ("algorithm.group_size", "batch.samples_per_prompt", 2),
    ("trainer.mini_batches", "batch.mini_batches", 2),
    ("trainer.ppo_epochs", "batch.ppo_epochs", 2),
    ("trainer.micro_batch_tokens", "batch.micro_batch_tokens", 512),
]


@pytest.mark.parametrize(("old", "new", "value"), MOVED)
def test_batch_sizes_moved_to_the_batch_section_name_the_new_key(tmp_path, old, new, value):
    expected = f"unknown key '{old}'; moved to '{new}'"
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{old}={value}"])
    assert expected in str(err.value) and err.value.moved == {old: new}
    section, key = old.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({section: {key: value}}))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert expected in str(err.value) and err.value.moved == {old: new}
    # the new key takes the value, with the old default and bounds
    new_section, new_key = new.split(".")
    assert getattr(getattr(load_config(None, [f"{new}={value}"]), new_section), new_key) == value
    with pytest.raises(ConfigError, match=f"'{new}': got 0"):
        load_config(None, [f"{new}=0"])


def test_batch_section_defaults_are_the_old_ones():
    b = RunConfig().batch
    assert (b.prompts_per_step, b.samples_per_prompt, b.mini_batches, b.ppo_epochs, b.micro_batch_tokens) == (
        4,
        8,
        1,
        1,
        4096,
    )
    for name, field in type(b).model_fields.items():
        assert "verl" in (field.description or ""), name  # each key names its verl equivalent
