"""An exported model is ready for inference: use_cache on in config.json and generation_config.json (training
turns it off), every file with the same permissions (the safetensors came out 0600). No processes."""

from transformers import LlamaConfig, LlamaForCausalLM

from ndparallel.weights.export import checkpoint_step, save_for_inference


def test_save_for_inference_turns_the_cache_on_and_evens_the_modes(tmp_path):
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64
    )
    config.use_cache = False  # as weights/materialize.py sets it for training
    model = LlamaForCausalLM(config)
    model.generation_config.use_cache = False
    save_for_inference(model, tmp_path / "hf")
    written = LlamaConfig.from_pretrained(tmp_path / "hf")
    assert written.use_cache is True
    assert '"use_cache": true' in (tmp_path / "hf" / "generation_config.json").read_text()
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert len(set(modes.values())) == 1, modes
    assert model.config.use_cache is False  # the live model's own config is left as it was


def test_checkpoint_step_from_its_name(tmp_path):
    assert checkpoint_step(tmp_path / "step-120") == 120
    assert checkpoint_step(tmp_path / "latest-copy") is None
