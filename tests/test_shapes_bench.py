"""`python -m latency_bench shapes`: the real-shape configurations are the public
checkpoints' (checked against transformers' and diffusers' own classes, on the meta
device), the bench runs every stage's own step at tiny shapes, and the real
configurations run through the same code with their stacks cut to one layer."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from latency_bench import shape_configs as sc


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _same(ours: dict[str, Any], theirs: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """Keys of our configuration whose value differs from the config object's."""
    diff = []
    for k, v in ours.items():
        if k in skip or isinstance(v, dict) or k in ("model_type", "architectures", "torch_dtype", "dtype", "rope_theta", "rope_scaling"):
            continue
        got = json.loads(json.dumps(getattr(theirs, k)))  # tuples as lists
        if got != v:
            diff.append(f"{k}: ours {v!r}, the class's {got!r}")
    return diff


def test_the_config_classes_that_default_to_the_public_checkpoints_agree() -> None:
    """transformers' Moshi, Mimi, π0, Qwen2.5-Omni token2wav and Qwen3-Omni code2wav config
    classes default to the checkpoints the bench names (their docstrings say so): our
    values are theirs; the Flux DiT's diffusers defaults are FLUX.1's but for the guidance
    embedding FLUX.1-dev has."""
    import diffusers
    import transformers

    moshi = transformers.MoshiConfig()
    assert _same(sc.MOSHI, moshi) == []
    assert _same(sc.MOSHI["depth_decoder_config"], moshi.depth_decoder_config) == []
    assert _same(sc.MIMI, transformers.MimiConfig(), skip=("frame_rate",)) == []
    assert transformers.MimiConfig().frame_rate == sc.MIMI["frame_rate"]

    pi0 = transformers.PI0Config()
    assert _same(sc.PI0, pi0) == []
    assert _same(sc.PI0["vlm_config"], pi0.vlm_config) == []
    assert _same(sc.PI0["vlm_config"]["vision_config"], pi0.vlm_config.vision_config) == []
    assert _same(sc.PI0["vlm_config"]["text_config"], pi0.vlm_config.text_config) == []
    assert _same(sc.PI0["dit_config"], pi0.dit_config) == []

    t2w = transformers.Qwen2_5OmniConfig().token2wav_config
    assert _same(sc.OMNI["token2wav_config"]["dit_config"], t2w.dit_config, skip=("max_position_embeddings",)) == []
    assert _same(sc.OMNI["token2wav_config"]["bigvgan_config"], t2w.bigvgan_config) == []
    # the 7B talker reads the 7B thinker's states: transformers' default thinker is the 7B's
    assert sc.OMNI["talker_config"]["embedding_size"] == transformers.Qwen2_5OmniConfig().thinker_config.text_config.hidden_size

    c2w = transformers.Qwen3OmniMoeConfig().code2wav_config
    assert _same(sc.OMNI3["code2wav_config"], c2w, skip=("rope_theta",)) == []

    # (a default Flux DiT would allocate 12B parameters: its signature's defaults are compared)
    defaults = {k: p.default for k, p in inspect.signature(diffusers.FluxTransformer2DModel.__init__).parameters.items() if k != "self"}
    ours = dict(sc.FLUX["transformer_config"])
    assert ours.pop("guidance_embeds") is True and defaults.pop("guidance_embeds") is False
    assert {k: list(v) if isinstance(v, tuple) else v for k, v in defaults.items() if k in ours} == ours


@pytest.mark.parametrize("family", sc.FAMILIES)
def test_the_real_configurations_build_at_the_published_sizes(family: str) -> None:
    """Built in transformers' / diffusers' own classes on the meta device (shapes, no memory):
    the parameter counts are the published checkpoints'."""
    import diffusers
    import transformers

    conf = sc.configuration(family, "real")
    with torch.device("meta"):
        if family == "moshi":
            m = transformers.MoshiForConditionalGeneration._from_config(sc.transformers_config(family, conf))
            assert 7.6e9 < _params(m) < 7.8e9  # "7B": the temporal transformer, the depth decoder, Mimi
            assert _params(m.audio_encoder) == pytest.approx(79.3e6, rel=0.01)  # Mimi
        elif family == "pi0":
            m = transformers.PI0ForConditionalGeneration._from_config(sc.transformers_config(family, conf))
            assert _params(m) == pytest.approx(3.5e9, rel=0.02)  # PaliGemma 3B + the 300M action expert
        elif family == "omni":
            from pipelines.omni.models import OmniTalkerModule, Token2WavModule

            cfg = sc.transformers_config(family, conf)
            talker = OmniTalkerModule(None, slots=1, max_len=8, config=cfg, thinker=True)
            t2w = Token2WavModule(None, config=cfg)
            # Qwen2.5-Omni-7B is 10.7B parameters: the thinker's language model and audio tower (transformers'
            # defaults are the 7B's), its vision tower (Qwen2.5-VL's 0.68B ViT: not the default here), talker, token2wav
            th = talker.thinker
            total = _params(th.model) + 0.545e9 + _params(th.audio_tower) + 0.676e9 + _params(talker.talker) + _params(t2w)  # (+ the untied LM head)
            assert total == pytest.approx(10.73e9, rel=0.005)
            assert talker.kv.shape[1:] == (24, 2, 4, 8, 128)  # the slot cache: 24 layers, 4 KV heads of 128
        elif family == "omni3":
            from pipelines.omni3.models import Omni3Code2WavModule, Omni3TalkerModule

            cfg = sc.transformers_config(family, conf)
            talker = Omni3TalkerModule(None, slots=1, max_len=8, config=cfg, thinker=False)
            assert talker.thinker is None and talker.groups == 16
            assert 3.2e9 < _params(talker.talker) < 3.4e9  # the MoE talker (128 experts) and its code predictor
            experts = [m for m in talker.talker.modules() if type(m).__name__ == "Qwen3OmniMoeTalkerTextExperts"]
            assert len(experts) == 20 and experts[0].num_experts == 128
            assert _params(Omni3Code2WavModule(None, config=cfg)) == pytest.approx(216e6, rel=0.01)
        else:
            tf = getattr(diffusers, conf["transformer"]).from_config(conf["transformer_config"])
            expected = {"wan": 1.419e9, "skyreels": 1.436e9, "flux": 11.90e9}[family]  # "1.3B" (both), "12B"
            assert _params(tf) == pytest.approx(expected, rel=0.005)
            vae = getattr(diffusers, conf["vae"]).from_config(conf["vae_config"])
            assert _params(vae) == pytest.approx({"wan": 127e6, "skyreels": 127e6, "flux": 83.8e6}[family], rel=0.01)


def test_shallow_cuts_every_stack_and_keeps_the_widths() -> None:
    cut = sc.shallow(sc.configuration("pi0", "real"), 1)
    assert cut["vlm_config"]["text_config"]["num_hidden_layers"] == 1 and cut["dit_config"]["num_hidden_layers"] == 1
    assert cut["vlm_config"]["vision_config"]["num_hidden_layers"] == 1
    assert cut["vlm_config"]["text_config"]["hidden_size"] == 2048
    flux = sc.shallow(sc.configuration("flux", "real"), 2)["transformer_config"]
    assert (flux["num_layers"], flux["num_single_layers"], flux["num_attention_heads"]) == (2, 2, 24)
    assert sc.REAL["pi0"]["dit_config"]["num_hidden_layers"] == 18  # the published configuration is untouched


def test_an_aged_moshi_slot_attends_over_its_whole_window() -> None:
    """`SlotCache.age`: a conversation far along (the shapes bench's steady state) holds the
    last `window` positions; the next step attends over exactly those."""
    from pipelines.moshi.steps import SlotCache

    c = SlotCache(layers=1, kv_heads=1, head_dim=2, window=6, step_tokens=1, dtype=torch.float32)
    c.grow(2)
    rows = torch.tensor([0, 1])
    c.age(rows[1:], 20)
    assert c.held[1].tolist() == [14, 15, 16, 17, 18, 19, 20 - 7] and c.next.tolist() == [0, 20]
    pos, mask = c.begin(rows[1:], 1)
    assert pos.tolist() == [[20]]
    seen = sorted(int(h) for h, m in zip(c.held[1].tolist(), mask[0, 0, 0].tolist(), strict=True) if m == 0)
    assert seen == [15, 16, 17, 18, 19, 20]  # the window: the new position and the 5 before it
    c.age(rows[:1], 3)  # shorter than the ring: the rest stays empty
    assert c.held[0].tolist() == [0, 1, 2, -1, -1, -1, -1]


def test_skyreels_fps_embedding_rows_share_one_forward() -> None:
    """A SkyReels-V2 DF transformer with the fps embedding (`inject_sample_info`, as the
    1.3B checkpoint has) steps a batch of live chunks in one forward, each row as it
    would step alone."""
    import asyncio

    from diffusers import AutoencoderKLWan, SkyReelsV2DiffusionForcingPipeline, SkyReelsV2Transformer3DModel, UniPCMultistepScheduler

    from omni_rt.engines.diffusers_engine import DiffusersEngine, DiffusionJob

    torch.manual_seed(3)
    tf = SkyReelsV2Transformer3DModel(num_attention_heads=2, attention_head_dim=12, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2,
                                      inject_sample_info=True)
    with torch.no_grad():
        for p in tf.parameters():
            p.normal_(0, 0.1)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
    pipe = SkyReelsV2DiffusionForcingPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=tf,
                                              scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=8.0))
    engine = DiffusersEngine("<built>", name="df", pipeline=pipe)
    forwards = []
    tf.register_forward_hook(lambda _m, a, k, _o: forwards.append(k["hidden_states"].shape[0]), with_kwargs=True)

    def jobs(seeds: list[int]) -> list[DiffusionJob]:
        out = []
        for i, seed in enumerate(seeds):
            g = torch.Generator().manual_seed(100 + seed)
            j = DiffusionJob("p", 32, 32, steps=2, seed=seed, frames=4, fps=24.0, prefix=torch.randn(16, 2, 4, 4, generator=g))
            j.id = i + 1
            out.append(j)
        return out

    async def go() -> None:
        await engine.start()
        try:
            engine._prompts["p"] = (torch.randn(8, 32, generator=torch.Generator().manual_seed(0)),)
            both = jobs([1, 2])
            engine._prepare(both)
            while both[0].step < both[0].steps:
                engine._step(both)
            assert set(forwards) == {2}  # one forward carries both rows
            for k, seed in enumerate([1, 2]):
                alone = jobs([seed])
                engine._prepare(alone)
                while alone[0].step < alone[0].steps:
                    engine._step(alone)
                assert torch.allclose(alone[0].latents, both[k].latents, atol=1e-5)
        finally:
            await engine.stop()

    asyncio.run(go())


def _figures(r: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    from latency_bench.shapes import _all_levels

    return [(f"{where} {n}", x) for where, levels in _all_levels(r) for n, x in levels.items()]


@pytest.mark.integration  # every stage's engine on the tiny checkpoints' configurations
def test_the_bench_runs_every_stage_at_tiny_shapes(models_dir: Path, tmp_path: Path) -> None:
    from latency_bench.__main__ import main

    out = tmp_path / "shapes.json"
    assert main(["shapes", "--shapes", "tiny", "--repeat", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["schema"] == "omni-rt.latency_bench.shapes/1"
    assert set(result["versions"]) >= {"torch", "transformers", "diffusers"}
    fams = result["families"]
    assert list(fams) == list(sc.FAMILIES)
    for fam, r in fams.items():
        assert r["checkpoint"] == f"tiny:{sc.TINY[fam]}" and r["parameters"] > 0, fam
        figures = _figures(r)
        assert figures and all("skipped" not in x and "error" not in x and "oom" not in x for _, x in figures), (fam, figures)
    m = fams["moshi"]["levels"]
    assert list(m) == ["1", "2"] and all(x["step_ms_full_window"] > 0 and x["step_ms"] > 0 for x in m.values())
    # every conversation in one batched engine step a frame (and every answer in one talker step)
    assert [x["engine_steps_per_frame"] for x in m.values()] == [1, 1]
    assert all(x["engine_steps_per_step"] == 1 for f in ("omni", "omni3") for x in fams[f]["talker"].values())
    assert fams["moshi"]["context_frames"] == 3000  # the tiny Moshi's window, as the real one's
    assert set(fams["pi0"]["views"]) == {"1", "2"} and all(x["chunk_ms"] >= x["encode_ms"] > 0 for lv in fams["pi0"]["views"].values()
                                                         for x in lv.values())
    for fam, codec in (("omni", "token2wav"), ("omni3", "code2wav")):
        assert all(x["step_ms"] > 0 and x["rtf"] > 0 for x in fams[fam]["talker"].values())
        assert all(x["window_ms"] > 0 for x in fams[fam][codec]["levels"].values())
    assert fams["omni"]["token2wav"]["window_codes"] == 12 + 50 + 24  # the voice profile's chunking
    assert fams["omni3"]["code2wav"]["window_frames"] == 12 + 25 + 1
    assert all(x["step_ms"] > 0 for f in ("wan", "flux") for x in fams[f]["levels"].values())
    assert all(x["decode_ms"] > 0 for x in fams["flux"]["levels"].values())
    assert fams["wan"]["levels"]["1"]["decode_ms"] > 0 and "decode_ms" not in fams["wan"]["levels"]["2"]  # a clip's decode, once
    sky = fams["skyreels"]
    assert all(x["fps_per_session"] > 0 and x["forwards_per_chunk"] >= 2 for x in sky["levels"].values())
    assert sky["steps"] == 6 and sky["history_latent_frames"] == 2  # pipelines/video_edit.yaml's processor_args
    assert [sky["levels"][n]["rows_per_forward"] for n in ("1", "2")] == [1, 2]


# the families whose real configurations take code paths the tiny ones do not: π0's 224-px views, the full-duplex
# model at Moshi 7B's widths, the 128-expert MoE talker with 16 code groups, the fps embedding and guidance of
# SkyReels-V2 DF, FLUX.1-dev's guidance embedding (Qwen2.5-Omni's and Wan's are checked on the meta device above:
# at full width on two cores, token2wav's windows alone take most of a minute)
SHALLOW = "moshi,pi0,omni3,skyreels,flux"


@pytest.mark.integration  # the public configurations through the same code, one layer a stack (a minute or two on two cores)
def test_the_real_configurations_run_through_the_stages_cut_to_one_layer(tmp_path: Path) -> None:
    from latency_bench.__main__ import main

    out = tmp_path / "shapes.json"
    assert main(["shapes", "--shapes", "real", "--layers", "1", "--batches", "1", "--repeat", "1", "--families", SHALLOW, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["layers"] == 1 and "not the checkpoints' timings" in result["config"]["timings"]
    fams = result["families"]
    for fam, r in fams.items():
        assert r["checkpoint"] == sc.CHECKPOINTS[fam]
        figures = _figures(r)
        assert figures and all("skipped" not in x and "error" not in x for _, x in figures), (fam, figures)
    assert fams["pi0"]["views"]["1"]["1"]["prefix_tokens"] == 256 + 48  # SigLIP at 224 px: 256 tokens a view, the 48-token prompt
    assert list(fams) == SHALLOW.split(",")
    assert fams["omni3"]["code_groups"] == 16 and fams["omni3"]["frame_ms"] == 80.0
    assert fams["moshi"]["context_frames"] == 3000 and fams["moshi"]["levels"]["1"]["engine_steps_per_frame"] == 1
    sky = fams["skyreels"]
    assert (sky["steps"], sky["history_latent_frames"], sky["guidance_scale"], sky["video_fps"]) == (30, 5, 6.0, 24)  # the example overlay
    assert sky["levels"]["1"]["rows_per_forward"] == 2  # guided: a conditional and an unconditional row


def test_levels_stop_at_the_budget_forecast_and_at_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A level whose forecast (the last level's time scaled by the batch) would pass the family's
    share is skipped; running out of memory ends the levels; the summary names what bounds it."""
    import asyncio

    from latency_bench import shapes

    now = [0.0]
    monkeypatch.setattr(shapes.time, "monotonic", lambda: now[0])
    run = shapes.Run("tiny", torch.device("cpu"), torch.float32, 1, budget_s=100.0, batches=None, models=None)
    run.family_deadline = 100.0

    async def one(n: int) -> dict[str, Any]:
        now[0] += 10.0 * n  # a level's seconds grow with its batch
        if n == 16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"ms": 10.0 * n}

    out = asyncio.run(run.over([1, 2, 4, 8], one))
    assert [k for k, v in out.items() if "ms" in v] == ["1", "2", "4"]  # 10 + 20 + 40 s; 8 would take ~80 s more
    assert "the next level would take ~80 s" in out["8"]["skipped"]
    assert shapes._largest(out, lambda r: r["ms"] <= 20) == {"batch": 2, "bounded_by": "time"}
    assert shapes._largest(out, lambda r: True) == {"batch": 4, "bounded_by": None}

    now[0], run.family_deadline = 0.0, 1e9
    out = asyncio.run(run.over([8, 16, 32], one))
    assert "oom" in out["16"] and out["32"] == {"skipped": "out of memory at a smaller batch"}
    assert shapes._largest(out, lambda r: True) == {"batch": 8, "bounded_by": "memory"}


@pytest.mark.integration  # a family in a process of its own
def test_an_isolated_family_reports_from_its_own_process(models_dir: Path, tmp_path: Path) -> None:
    from latency_bench.__main__ import main

    out = tmp_path / "shapes.json"
    assert main(["shapes", "--shapes", "tiny", "--families", "flux", "--batches", "1", "--repeat", "1", "--isolate", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["isolated"] is True and result["versions"]["torch"]
    assert result["families"]["flux"]["levels"]["1"]["step_ms"] > 0
