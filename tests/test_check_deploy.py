"""`omni-rt check --deploy` on the documented real-weights overlays
(examples/deploy/*.yaml), from config and processor files alone: each model directory
gets the files its hub checkpoint has (config.json with its architectures, processor
and tokenizer files), no weights, and the check says whether each stage can load it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from omni_server.cli import main
from pipelines.tiny.pi0 import IMAGE_SIZE as TINY_SIDE

pytestmark = pytest.mark.integration  # each check reads the tiny checkpoints as real model directories (processors, tokenizers, configs)

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "deploy"

TOKENIZER = {"tokenizer.json": "{}", "tokenizer_config.json": json.dumps({"chat_template": "{{ messages }}"})}
WHISPER_FE = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128, "sampling_rate": 16000}
# what each hub checkpoint the overlays name holds, less its weights
CHECKPOINTS: dict[str, dict[str, str]] = {
    "Qwen2.5-Omni-3B": {
        "config.json": json.dumps({"architectures": ["Qwen2_5OmniModel"], "model_type": "qwen2_5_omni", "enable_audio_output": True}),
        "preprocessor_config.json": json.dumps({**WHISPER_FE, "processor_class": "Qwen2_5OmniProcessor", "image_processor_type": "Qwen2VLImageProcessor"}),
        "chat_template.json": json.dumps({"chat_template": "{{ messages }}"}),
        "vocab.json": "{}",
        "merges.txt": "",
    },
    # the same repo's 7B, as the omni profile reads it: thinker, talker and token2wav
    # configs, the speakers, sharded weights
    "Qwen2.5-Omni-7B": {
        "config.json": json.dumps({"architectures": ["Qwen2_5OmniModel"], "model_type": "qwen2_5_omni", "enable_audio_output": True,
                                   "thinker_config": {"audio_token_index": 151646}, "talker_config": {"vocab_size": 8448},
                                   "token2wav_config": {"dit_config": {}, "bigvgan_config": {}}}),
        "preprocessor_config.json": json.dumps({**WHISPER_FE, "processor_class": "Qwen2_5OmniProcessor", "image_processor_type": "Qwen2VLImageProcessor"}),
        "chat_template.json": json.dumps({"chat_template": "{{ messages }}"}),
        "vocab.json": "{}",
        "merges.txt": "",
        "spk_dict.pt": "",
        "model.safetensors.index.json": json.dumps({"weight_map": {}}),
        "model-00001-of-00005.safetensors": "",
    },
    # Qwen3-Omni as the omni3 profile reads it: its three configs (the speakers in the
    # talker's), its processor files, sharded weights
    "Qwen3-Omni-30B-A3B-Instruct": {
        "config.json": json.dumps({"architectures": ["Qwen3OmniMoeForConditionalGeneration"], "model_type": "qwen3_omni_moe",
                                   "enable_audio_output": True, "thinker_config": {"audio_token_id": 151675},
                                   "talker_config": {"speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303}},
                                   "code2wav_config": {"num_quantizers": 16}}),
        "preprocessor_config.json": json.dumps({**WHISPER_FE, "processor_class": "Qwen3OmniMoeProcessor", "image_processor_type": "Qwen2VLImageProcessor"}),
        "chat_template.json": json.dumps({"chat_template": "{{ messages }}"}),
        "vocab.json": "{}",
        "merges.txt": "",
        "model.safetensors.index.json": json.dumps({"weight_map": {}}),
        "model-00001-of-00016.safetensors": "",
    },
    "orpheus-3b-0.1-ft": {"config.json": json.dumps({"architectures": ["LlamaForCausalLM"]}), "tokenizer.json": "{}"},
    "snac_24khz": {
        "config.json": json.dumps({"sampling_rate": 24000, "codebook_size": 4096, "vq_strides": [4, 2, 1], "decoder_rates": [8, 8, 4, 2]}),
        "pytorch_model.bin": "",
    },
    # Moshi in transformers' format: the LM's config with Mimi's inside, the text tokenizer
    "hf-moshiko": {
        "config.json": json.dumps({"architectures": ["MoshiForConditionalGeneration"], "model_type": "moshi", "sliding_window": 3000,
                                   "audio_encoder_config": {"model_type": "mimi", "sampling_rate": 24000, "frame_rate": 12.5}}),
    },  # + the tiny Moshi's tokenizer files (_materialise)
    "whisper-large-v3-turbo": {"config.json": json.dumps({"architectures": ["WhisperForConditionalGeneration"]})},
    "Llama-3.2-3B-Instruct": {"config.json": json.dumps({"architectures": ["LlamaForCausalLM"]}), **TOKENIZER},
    # π0: the policy dirs hold config + lerobot's normalizer files, PaliGemma's the
    # tokenizer (the tiny π0's: its token ids must be the config's) and image settings
    "pi0_base": {},
    "pi0-droid": {},
    "paligemma2-3b-mix-224": {
        "preprocessor_config.json": json.dumps({"image_processor_type": "SiglipImageProcessor", "processor_class": "PaliGemmaProcessor",
                                                "size": {"height": TINY_SIDE, "width": TINY_SIDE}, "resample": 3, "image_mean": [0.5] * 3,
                                                "image_std": [0.5] * 3, "do_rescale": True, "rescale_factor": 1 / 255,
                                                "image_seq_length": (TINY_SIDE // 14) ** 2}),  # as PaliGemma-224's, at the tiny's size
    },
}
WAN_INDEX = {"_class_name": "WanPipeline", "_diffusers_version": "0.33.0", "boundary_ratio": None,
             "scheduler": ["diffusers", "UniPCMultistepScheduler"], "text_encoder": ["transformers", "UMT5EncoderModel"],
             "tokenizer": ["transformers", "T5TokenizerFast"], "transformer": ["diffusers", "WanTransformer3DModel"],
             "vae": ["diffusers", "AutoencoderKLWan"]}
CHECKPOINTS["Wan2.1-T2V-1.3B-Diffusers"] = {"model_index.json": json.dumps(WAN_INDEX)}
CHECKPOINTS["SkyReels-V2-DF-1.3B-540P-Diffusers"] = {
    "model_index.json": json.dumps({**WAN_INDEX, "_class_name": "SkyReelsV2DiffusionForcingPipeline", "transformer": ["diffusers", "SkyReelsV2Transformer3DModel"]})}
CHECKPOINTS["LTX-Video"] = {"model_index.json": json.dumps({
    "_class_name": "LTXPipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "text_encoder": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "T5TokenizerFast"], "transformer": ["diffusers", "LTXVideoTransformer3DModel"], "vae": ["diffusers", "AutoencoderKLLTXVideo"]})}
DROID_NORMALIZER = {"eps": 1e-8, "norm_map": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"},
                    "features": {"observation.state": {"type": "STATE", "shape": [8]}, "action": {"type": "ACTION", "shape": [8]}}}


def _pi0_files(ckpt: str, d: Path, tiny_pi0: Path) -> None:
    """What a π0 directory holds besides its weights: the config (the tiny one's sizes,
    so its token ids match the tokenizer the test gives PaliGemma's directory), and
    for the DROID fine-tune lerobot's normalizer files with 8-dim statistics."""
    from safetensors.numpy import save_file

    if ckpt.startswith("pi0"):
        shutil.copy(tiny_pi0 / "config.json", d / "config.json")
    if ckpt == "pi0-droid":
        stats = {f"{f}.{k}": np.full(8, v, np.float32) for f in ("observation.state", "action") for k, v in (("mean", 0.0), ("std", 1.0))}
        save_file(stats, str(d / "normalizer.safetensors"))
        for name, step in (("policy_preprocessor.json", "normalizer_processor"), ("policy_postprocessor.json", "unnormalizer_processor")):
            (d / name).write_text(json.dumps({"steps": [{"registry_name": step, "config": DROID_NORMALIZER, "state_file": "normalizer.safetensors"}]}))
    if ckpt.startswith("paligemma"):
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny_pi0 / f, d / f)


def _materialise(name: str, tmp: Path, models: Path, broken: dict[str, dict[str, str | None]] | None = None) -> Path:
    """The example overlay with its /models/… paths under `models`, each holding the
    checkpoint's files (`broken` replaces or removes some). The transcriptions API reads
    Whisper's languages from its tokenizer when it is mounted: that directory gets the
    tiny Whisper's tokenizer files (the hub layout, the real one's token names)."""
    text = (EXAMPLES / name).read_text()
    tiny_whisper = Path(os.environ["OMNI_RT_MODELS_DIR"]) / "tiny-whisper"
    for ckpt, files in CHECKPOINTS.items():
        d = models / ckpt
        d.mkdir(parents=True, exist_ok=True)
        _pi0_files(ckpt, d, Path(os.environ["OMNI_RT_MODELS_DIR"]) / "tiny-pi0")
        if ckpt == "hf-moshiko":
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(Path(os.environ["OMNI_RT_MODELS_DIR"]) / "tiny-moshi" / f, d / f)
        if ckpt.startswith("whisper"):
            for src in tiny_whisper.iterdir():
                if src.suffix in (".json", ".txt") and src.name not in ("config.json", "generation_config.json"):
                    shutil.copy(src, d / src.name)
        for f, body in {**files, **(broken or {}).get(ckpt, {})}.items():
            if body is None:
                (d / f).unlink(missing_ok=True)
            else:
                (d / f).write_text(body)
        text = text.replace(f"/models/{ckpt}", str(d))
    overlay = tmp / name
    overlay.write_text(text)
    return overlay


def _check(overlay: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(["check", "--deploy", str(overlay)])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("name,profile", [("qwen2.5-omni.yaml", "default"), ("cascade.yaml", "cascade")])
def test_documented_overlays_pass_the_check(name, profile, tmp_path, models_dir, monkeypatch, capsys):
    monkeypatch.setenv("OMNI_RT_MODELS_DIR", str(models_dir))  # the pipelines the overlay leaves on tiny
    overlay = _materialise(name, tmp_path, tmp_path / "models")
    rc, out, err = _check(overlay, capsys)
    assert rc == 0, err
    voice = json.loads(out)["voice"]
    stages = {s["name"]: s for s in voice["stages"]}
    spec = yaml.safe_load(overlay.read_text())["pipelines"]["voice"]["stages"]
    for stage, o in spec.items():
        assert stages[stage]["model"] == o["model"]  # the overlay's directory, as given
    assert voice["entry"] == {"default": "thinker", "cascade": "asr"}[profile]
    # the stages other pipelines share take the same directories
    tts = {s["name"]: s for s in json.loads(out)["tts"]["stages"]}
    assert tts["talker"]["model"] == stages["talker"]["model"]


def test_the_omni_voice_overlay_passes_the_check(tmp_path, models_dir, monkeypatch, capsys):
    monkeypatch.setenv("OMNI_RT_MODELS_DIR", str(models_dir))
    overlay = _materialise("qwen2.5-omni-voice.yaml", tmp_path, tmp_path / "models")
    rc, out, err = _check(overlay, capsys)
    assert rc == 0, err
    resolved = json.loads(out)
    stages = {s["name"]: s for s in resolved["voice"]["stages"]}
    assert {stages[n]["model"] for n in ("thinker", "omni_talker", "token2wav")} == {str(tmp_path / "models" / "Qwen2.5-Omni-7B")}
    assert resolved["voice"]["final_outputs"] == ["thinker", "token2wav", "asr"]
    assert "tts" not in resolved


def test_the_qwen3_omni_overlay_passes_the_check(tmp_path, models_dir, monkeypatch, capsys):
    monkeypatch.setenv("OMNI_RT_MODELS_DIR", str(models_dir))
    overlay = _materialise("qwen3-omni.yaml", tmp_path, tmp_path / "models")
    rc, out, err = _check(overlay, capsys)
    assert rc == 0, err
    resolved = json.loads(out)
    stages = {s["name"]: s for s in resolved["voice"]["stages"]}
    assert {stages[n]["model"] for n in ("thinker", "omni_talker", "omni_code2wav")} == {str(tmp_path / "models" / "Qwen3-Omni-30B-A3B-Instruct")}
    assert resolved["voice"]["final_outputs"] == ["thinker", "omni_code2wav", "asr"]


@pytest.mark.parametrize(("files", "expected"), [
    ({"config.json": json.dumps({"architectures": ["Qwen2_5OmniModel"], "thinker_config": {}, "talker_config": {}, "code2wav_config": {}})},
     "is not Qwen3OmniMoeForConditionalGeneration"),
    ({"config.json": json.dumps({"architectures": ["Qwen3OmniMoeForConditionalGeneration"], "thinker_config": {}, "talker_config": {}})},
     "config.json has no code2wav_config"),
    ({"preprocessor_config.json": None}, "needs its processor files (preprocessor_config.json"),
])
def test_a_broken_qwen3_omni_directory_is_named(files, expected, tmp_path, models_dir, monkeypatch, capsys):
    monkeypatch.setenv("OMNI_RT_MODELS_DIR", str(models_dir))
    overlay = _materialise("qwen3-omni.yaml", tmp_path, tmp_path / "models")
    ckpt = tmp_path / "models" / "Qwen3-Omni-30B-A3B-Instruct"
    for name, text in files.items():
        if text is None:
            (ckpt / name).unlink()
        else:
            (ckpt / name).write_text(text)
    rc, _, err = _check(overlay, capsys)
    assert rc != 0
    assert expected in err and str(ckpt) in err, err


@pytest.mark.parametrize("name", ["pi0.yaml", "pi0-droid.yaml"])
def test_documented_policy_overlays_pass_the_check(name, tmp_path, models_dir, monkeypatch, capsys):
    monkeypatch.setenv("OMNI_RT_MODELS_DIR", str(models_dir))
    overlay = _materialise(name, tmp_path, tmp_path / "models")
    rc, out, err = _check(overlay, capsys)
    assert rc == 0, err
    policy = json.loads(out)["robot"]["stages"][0]
    assert policy["model"] == yaml.safe_load(overlay.read_text())["pipelines"]["robot"]["stages"]["policy"]["model"]


def test_the_moshiko_overlay_passes_the_check(tmp_path, models_dir, monkeypatch, capsys):
    monkeypatch.setenv("OMNI_RT_MODELS_DIR", str(models_dir))
    overlay = _materialise("moshiko.yaml", tmp_path, tmp_path / "models")
    rc, out, err = _check(overlay, capsys)
    assert rc == 0, err
    resolved = json.loads(out)
    stage = resolved["moshi"]["stages"][0]
    assert stage["model"] == str(tmp_path / "models" / "hf-moshiko") and "voice" not in resolved


@pytest.mark.parametrize("name,pipeline,ckpt", [("wan2.1-t2v.yaml", "video", "Wan2.1-T2V-1.3B-Diffusers"), ("ltx-video.yaml", "video", "LTX-Video"),
                                                ("skyreels-v2-df.yaml", "video_edit", "SkyReels-V2-DF-1.3B-540P-Diffusers")])
def test_the_video_overlays_pass_the_check(name, pipeline, ckpt, tmp_path, models_dir, monkeypatch, capsys):
    monkeypatch.setenv("OMNI_RT_MODELS_DIR", str(models_dir))
    overlay = _materialise(name, tmp_path, tmp_path / "models")
    rc, out, err = _check(overlay, capsys)
    assert rc == 0, err
    assert json.loads(out)[pipeline]["stages"][0]["model"].endswith(ckpt)


@pytest.mark.parametrize("name,ckpt,broken,says", [
    ("wan2.1-t2v.yaml", "Wan2.1-T2V-1.3B-Diffusers", {"model_index.json": json.dumps({**WAN_INDEX, "_class_name": "FluxPipeline"})},
     "model_index.json names FluxPipeline, not a video pipeline this server runs (LTXPipeline, SkyReelsV2DiffusionForcingPipeline, WanPipeline)"),
    ("wan2.1-t2v.yaml", "Wan2.1-T2V-1.3B-Diffusers", {"model_index.json": None}, "no model_index.json"),
    ("skyreels-v2-df.yaml", "SkyReels-V2-DF-1.3B-540P-Diffusers", {"model_index.json": json.dumps(WAN_INDEX)},
     "names WanPipeline, not a diffusion-forcing pipeline"),
    ("pi0-droid.yaml", "pi0-droid", {"normalizer.safetensors": None}, "names the statistics file normalizer.safetensors, which is missing"),
    ("pi0.yaml", "paligemma2-3b-mix-224", {"preprocessor_config.json": None}, "no image processor settings"),
    ("pi0.yaml", "paligemma2-3b-mix-224", {"tokenizer.json": None}, "no tokenizer files"),
    ("pi0.yaml", "pi0_base", {"config.json": json.dumps({"architectures": ["PaliGemmaForConditionalGeneration"], "model_type": "paligemma"})},
     "describes PaliGemmaForConditionalGeneration, not π0"),
    ("qwen2.5-omni.yaml", "Qwen2.5-Omni-3B", {"preprocessor_config.json": None}, "processor files"),
    ("qwen2.5-omni.yaml", "Qwen2.5-Omni-3B", {"config.json": json.dumps({"architectures": ["Qwen2AudioForConditionalGeneration"]})},
     "Qwen2AudioForConditionalGeneration is neither a chat LM"),
    ("qwen2.5-omni.yaml", "Qwen2.5-Omni-3B", {"chat_template.json": None}, "no chat template"),
    ("qwen2.5-omni-voice.yaml", "Qwen2.5-Omni-7B", {"spk_dict.pt": None}, "no spk_dict.pt (the checkpoint's speakers)"),
    ("qwen2.5-omni-voice.yaml", "Qwen2.5-Omni-7B", {"config.json": json.dumps({"architectures": ["Qwen2_5OmniModel"], "thinker_config": {}})},
     "config.json has no talker_config"),
    ("qwen2.5-omni-voice.yaml", "Qwen2.5-Omni-7B", {"config.json": json.dumps({"architectures": ["Qwen2_5OmniModel"], "thinker_config": {},
                                                                               "talker_config": {}, "token2wav_config": {}, "enable_audio_output": False})},
     "enable_audio_output false"),
    ("moshiko.yaml", "hf-moshiko", {"config.json": json.dumps({"architectures": ["MimiModel"], "model_type": "mimi"})},
     "the moshi stage loads MoshiForConditionalGeneration (transformers' format, e.g. kmhf/hf-moshiko)"),
    ("moshiko.yaml", "hf-moshiko", {"config.json": json.dumps({"architectures": ["MoshiForConditionalGeneration"],
                                                               "audio_encoder_config": {"sampling_rate": 16000, "frame_rate": 12.5}})},
     "the moshi stage runs 24 kHz at 12.5 frames a second"),
    ("moshiko.yaml", "hf-moshiko", {"tokenizer.json": None, "tokenizer_config.json": None}, "no tokenizer for the text stream"),
    ("moshiko.yaml", "hf-moshiko", {"tokenizer.json": "{}"}, "the text stream's tokenizer does not load"),
    ("cascade.yaml", "whisper-large-v3-turbo", {"config.json": json.dumps({"architectures": ["LlamaForCausalLM"]})},
     "is not WhisperForConditionalGeneration"),
    ("cascade.yaml", "Llama-3.2-3B-Instruct", {"tokenizer.json": None}, "no tokenizer files"),
    ("cascade.yaml", "snac_24khz", {"config.json": json.dumps({"sampling_rate": 24000})}, "not a SNAC config"),
    ("cascade.yaml", "orpheus-3b-0.1-ft", {"config.json": "{not json"}, "not readable JSON"),
])
def test_the_check_names_what_a_directory_lacks(name, ckpt, broken, says, tmp_path, models_dir, monkeypatch, capsys):
    monkeypatch.setenv("OMNI_RT_MODELS_DIR", str(models_dir))
    overlay = _materialise(name, tmp_path, tmp_path / "models", {ckpt: broken})
    rc, _, err = _check(overlay, capsys)
    assert rc == 2
    assert says in err and ".model:" in err, err


def test_the_check_says_a_realtime_stage_computes_in_float32_on_a_cpu(tmp_path, models_dir, monkeypatch, capsys):
    """moshiko.yaml's bfloat16 on a CPU: the check names the stage and what it will do."""
    monkeypatch.setenv("OMNI_RT_MODELS_DIR", str(models_dir))
    overlay = _materialise("moshiko.yaml", tmp_path, tmp_path / "models")
    overlay.write_text(overlay.read_text().replace("device: cuda", "device: cpu"))
    rc, _, err = _check(overlay, capsys)
    assert rc == 0, err
    assert "note: stage moshi: bfloat16 from engine_args.dtype on a CPU" in err and "it will compute in float32" in err, err


@pytest.mark.parametrize("pipeline, stage, args, says", [
    ("moshi", "moshi", {"budget_headroom": -1}, "moshi: budget_headroom: Input should be greater than 0"),
    ("moshi", "moshi", {"max_sessions": "many"}, "moshi: max_sessions: Input should be a valid integer"),
    ("voice", "thinker", {"tool_strict_level": "bogus"}, "thinker: tool_strict_level: Input should be 'auto', 'function' or 'parameter'"),
    ("voice", "thinker", {"top_p": 0}, "thinker: top_p: Input should be greater than 0"),
    ("tts", "talker", {"publish_frames": 0}, "talker: publish_frames: Input should be greater than or equal to 1"),
    ("asr", "asr", {"max_tokens": 1}, "asr: max_tokens: Input should be greater than or equal to 2"),
    ("voice", "thinker", {"max_token": 5}, "thinker: max_token: Extra inputs are not permitted"),
    ("image", "dit", {"default_steps": 60, "max_steps": 50}, "image: default_steps 60 is over max_steps 50"),
    ("image", "dit", {"default_size": "big"}, "image: default_size: String should match pattern"),
    ("video", "t2v", {"max_frames": 0}, "video: max_frames: Input should be greater than or equal to 1"),
    ("video_edit", "video_dit", {"history_latent_frames": 0}, "forcing: history_latent_frames: Input should be greater than or equal to 1"),
])
def test_the_check_refuses_processor_args_of_the_wrong_type_or_range(pipeline, stage, args, says, tmp_path, models_dir, monkeypatch, capsys):
    monkeypatch.setenv("OMNI_RT_MODELS_DIR", str(models_dir))
    overlay = tmp_path / "bad.yaml"
    overlay.write_text(yaml.safe_dump({"pipelines": {pipeline: {"stages": {stage: {"processor_args": args}}}}}))
    rc, _, err = _check(overlay, capsys)
    assert rc == 2
    # (a stage two pipelines share is named under the first that builds it)
    assert f".stages.{stage}.processor_args: {says}" in err and "omni-rt: error: pipelines." in err, err
