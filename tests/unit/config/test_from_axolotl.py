"""Axolotl configs as written: translations into ndparallel's settings, the policy table's "not used" and
"refused" answers, Axolotl's defaults and meanings (schedule, cadence, clipping, world fill)."""

import pytest

from ndparallel.config.axolotl_fields import POLICY, rule_for
from ndparallel.config.reading import read_config
from ndparallel.train.schedule import schedule_for

BASE = {"base_model": "org/model", "datasets": [{"path": "data.jsonl", "type": "alpaca"}]}


def test_placeholders_and_kernel_choices_are_reported_in_one_line():
    reading = read_config(
        {
            **BASE,
            "tf32": True,
            "attn_implementation": "flash_attention_2",
            "wandb_project": None,
            "load_in_4bit": False,
            "hub_model_id": "",
            "strict": False,
            "deepspeed": "zero3.json",
            "plugins": ["axolotl.integrations.liger.LigerPlugin"],
            "learning_rate": None,
            "lora_model_dir": None,
        }
    )
    assert reading.errors == []
    (line,) = reading.notes
    assert line.startswith("not used: ") and "\n" not in line
    assert "attn_implementation (kernel or attention implementation" in line
    assert "plugins: LigerPlugin (kernel plugin" in line and "deepspeed (DeepSpeed" in line
    assert "hub_model_id, strict, lora_model_dir (left empty)" in line
    assert reading.config.learning_rate == 2e-5  # null is Axolotl's "unset": the default applies


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"rl": "dpo"}, "rl: 'dpo' — preference, reinforcement-learning and reward-model training are not supported"),
        ({"adapter": "qlora"}, "adapter: qlora needs load_in_4bit: true"),
        ({"load_in_4bit": True}, "load_in_4bit: true needs adapter: qlora"),
        ({"gptq": True}, "gptq: True — quantized weights"),
        ({"train_attn": True}, "train_attn: True — this way of choosing the weights to train is not implemented"),
        ({"unfrozen_parameters": ["^model.embed_tokens.weight$[:32000]"]}, "trains only the rows [:32000] of a tensor"),
        ({"plugins": ["axolotl.integrations.diffusion.DiffusionPlugin"]}, "plugins: 'axolotl.integrations.diffusion"),
        ({"model_type": "AutoModelForSequenceClassification"}, "only *ForCausalLM classes can be trained"),
        ({"shuffle_merged_datasets": False}, "shuffle_merged_datasets: False — this changes which data"),
        ({"bf16": "full"}, "bf16: full (bf16 weights, no fp32 copy) needs an update that rounds"),
        ({"bf16": "full", "optimizer": "adamw_8bit", "adapter": "lora", "lora_target_linear": True}, "bf16: full with"),
        ({"save_strategy": "best"}, "save_strategy: best (keep the checkpoint with the best eval metric)"),
        ({"warmup_steps": 10, "warmup_ratio": 0.1}, "warmup_steps and warmup_ratio are both set: keep one"),
        (
            {"fsdp_config": {"fsdp_offload_parms": True}},
            "unknown setting fsdp_config.fsdp_offload_parms; did you mean 'offload_params'?",
        ),
        ({"datasets": [{"path": "d", "type": "alpaca", "field_chosen": "c"}]}, "datasets[0].field_chosen: 'c' —"),
        ({"model_typ": "x"}, "unknown setting 'model_typ'; did you mean 'model_type'?"),
    ],
)
def test_settings_that_change_the_result_are_refused_in_one_line(extra, message):
    errors = read_config({**BASE, **extra}).errors
    assert any(message in line for line in errors), errors
    assert all("\n" not in line for line in errors)


def test_bf16_full_is_axolotls_pure_bf16_full_fine_tune():
    config = read_config({**BASE, "bf16": "full", "optimizer": "adamw_bnb_8bit"}).config
    assert config.bf16 == "full" and config.eight_bit_optimizer


def test_wandb_settings_are_kept_and_used():
    # W&B is wired (train/tracking.py, tested offline in tests/multirank/test_tracking.py): nothing is "not used".
    reading = read_config({**BASE, "wandb_project": "p", "wandb_watch": "gradients", "wandb_entity": None})
    assert reading.config.wandb_project == "p" and reading.config.wandb_entity is None
    assert reading.config.wandb_watch == "gradients"
    assert not any("wandb" in note for note in reading.notes), reading.notes


def test_unrelated_names_get_no_did_you_mean():
    (line,) = read_config({**BASE, "xyzzy_frobnicate": 1}).errors
    assert line == "unknown setting 'xyzzy_frobnicate'; see `ndparallel validate --help-fields`"


def test_fsdp_settings_translate_and_the_config_own_setting_wins():
    cfg = read_config(
        {
            **BASE,
            "fsdp": ["full_shard", "auto_wrap"],
            "fsdp_version": 2,
            "fsdp_config": {
                "offload_params": True,
                "reshard_after_forward": False,
                "activation_checkpointing": True,
                "cpu_ram_efficient_loading": True,
                "state_dict_type": "FULL_STATE_DICT",
            },
        }
    ).config
    assert (cfg.cpu_offload, cfg.reshard_after_forward, cfg.ac_mode) == (True, False, "full")
    reading = read_config(
        {
            **BASE,
            "cpu_offload": False,
            "fsdp_config": {"fsdp_offload_params": True, "fsdp_sharding_strategy": "SHARD_GRAD_OP"},
        }
    )
    assert reading.config.cpu_offload is False and reading.config.reshard_after_forward is False
    assert (
        "fsdp_config.fsdp_offload_params says cpu_offload=True but the config sets cpu_offload=False"
        in reading.notes[-1]
    )


def test_other_axolotl_spellings_translate():
    cfg = read_config(
        {
            **BASE,
            "ring_attn_func": "batch_ring",
            "sequence_parallel_degree": 2,
            "bfloat16": True,
            "excess_length_strategy": "raise",
            "model_config": {"rope_theta": 1e6},
            "ddp_timeout": 60,
            "model_revision": "v1",
            "heads_k_stride": 1,
        }
    ).config
    assert (cfg.cp_comm_strategy, cfg.context_parallel_size, cfg.bf16, cfg.long_rows) == ("ring", 2, True, "error")
    assert cfg.model_config_overrides == {"rope_theta": 1e6} and cfg.process_group_timeout_s == 60
    assert cfg.revision_of_model == "v1"


def test_every_policy_line_has_a_reason_and_no_name_twice():
    names = [name for names, _ in POLICY for name in names.split()]
    assert len(names) == len(set(names)), sorted(n for n in set(names) if names.count(n) > 1)
    assert all(rule.why for _, rule in POLICY)
    assert rule_for("liger_rms_norm").refuse_if is None and rule_for("rl").refuses("dpo")
    assert not rule_for("rl").refuses(None) and not rule_for("gptq").refuses(False)


def test_axolotl_defaults_and_meanings():
    cfg = read_config(BASE).config
    assert (cfg.adam_beta2, cfg.clip_norm, cfg.save_total_limit, cfg.sequence_len, cfg.long_rows_policy) == (
        0.999,
        1.0,
        4,
        512,
        "drop",
    )
    assert read_config({**BASE, "max_grad_norm": 0}).config.clip_norm is None
    assert read_config({**BASE, "max_grad_norm": None}).config.clip_norm == 1.0


def test_world_fill_with_replicas_when_fixed_sizes_use_fewer_ranks():
    cfg = read_config({**BASE, "dp_shard_size": 2, "context_parallel_size": 2, "tensor_parallel_size": 2}).config
    assert cfg.parallelism(world_size=16).resolve(16).shape == (2, 2, 2, 2)
    assert cfg.parallelism(world_size=8).resolve(8).shape == (1, 2, 2, 2)
    fixed = read_config({**BASE, "dp_replicate_size": 1, "dp_shard_size": 2}).config
    with pytest.raises(Exception, match="= 2, but 4 processes were started"):
        fixed.parallelism(world_size=4).resolve(4)


def _schedule(steps_per_epoch=10, **settings):
    return schedule_for(read_config({**BASE, **settings}).config, steps_per_epoch=steps_per_epoch)


def test_schedule_defaults_are_axolotls():
    s = _schedule(steps_per_epoch=100, num_epochs=2)
    assert (s.total_steps, s.warmup_steps, s.log_every, s.save_every, s.eval_every) == (200, 6, 1, 100, None)
    assert _schedule(steps_per_epoch=10_000).warmup_steps == 100 and _schedule(steps_per_epoch=10_000).log_every == 10
    assert _schedule(max_steps=50, warmup_ratio=0.1).warmup_steps == 5
    assert _schedule(max_steps=50, warmup_steps=0.2).warmup_steps == 10


def test_saves_and_evals_per_epoch_are_fractions_of_all_steps():
    s = _schedule(max_steps=9, num_epochs=3, saves_per_epoch=1, evals_per_epoch=2, val_set_size=0.1)
    assert (s.save_every, s.eval_every) == (3, 2)  # ceil(9 / 3), ceil(9 / 6)
    assert [step for step in range(1, 10) if s.saving(step)] == [3, 6, 9]
    assert _schedule(max_steps=9, saves_per_epoch=1).save_every is None  # 1 / (1 x 1 epoch): the end only
    assert _schedule(max_steps=10, save_steps=0.25).save_every == 3
    assert _schedule(max_steps=10, save_strategy="no").save_every is None


@pytest.mark.parametrize(
    "kind, factors",
    [
        ("constant", [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("constant_with_warmup", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]),  # decays over the 4 steps after warm-up
    ],
)
def test_lr_schedules(kind, factors):
    s = _schedule(max_steps=6, warmup_steps=2, lr_scheduler=kind)
    assert [s.lr_factor(i) for i in range(6)] == pytest.approx(factors)


def test_cosine_with_a_floor_and_a_constant_tail():
    s = _schedule(max_steps=10, warmup_steps=0, cosine_min_lr_ratio=0.1)
    assert s.lr_factor(0) == pytest.approx(1.0) and s.lr_factor(10) == pytest.approx(0.1)
    held = _schedule(max_steps=10, warmup_steps=0, cosine_min_lr_ratio=0.1, cosine_constant_lr_ratio=0.5)
    assert [held.lr_factor(i) for i in (5, 7, 9)] == pytest.approx([0.1, 0.1, 0.1])


def test_lora_target_modules_as_a_regex_matches_full_module_paths():
    from support.scenarios import make_model

    from ndparallel.adapters.lora import LoraSpec, peft_config_dict, target_paths

    regex = r".*layers\.1\.self_attn\.(q|v)_proj"
    spec = LoraSpec.from_config(read_config({**BASE, "adapter": "lora", "lora_target_modules": regex}).config)
    assert target_paths(make_model("llama"), spec) == [
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
    ]
    assert peft_config_dict(spec, None)["target_modules"] == regex
    (error,) = read_config({**BASE, "adapter": "lora", "lora_target_modules": "(q_proj"}).errors
    assert error.startswith("lora_target_modules: '(q_proj' is not a valid regular expression")
