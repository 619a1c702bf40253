"""The Flux family's guidance: a guidance-distilled DiT (FLUX.1-dev's `guidance_embeds`)
takes the request's scale as its guidance embedding in one row, as diffusers'
FluxPipeline does with `guidance_scale`; a DiT without it runs true classifier-free
guidance (an unconditional row beside each job's)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch


@pytest.mark.parametrize("distilled", [True, False])
def test_flux_guidance_is_the_embedding_of_a_distilled_dit(distilled: bool) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    from omni_rt.engines.diffusers_engine import DiffusersEngine, DiffusionJob

    torch.manual_seed(0)
    tf = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                                joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=distilled, axes_dims_rope=(4, 6, 6))
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), vae=None, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=tf)
    engine = DiffusersEngine("<built>", name="flux", pipeline=pipe)
    seen: list[dict[str, Any]] = []
    tf.register_forward_hook(lambda _m, _a, k, _o: seen.append({"rows": k["hidden_states"].shape[0], "guidance": k["guidance"]}), with_kwargs=True)

    async def go() -> DiffusionJob:
        await engine.start()
        try:
            engine._prompts["a cat"] = engine._prompts[""] = (torch.randn(8, 32), torch.randn(32))
            job = DiffusionJob("a cat", 32, 32, steps=2, seed=1, guidance_scale=3.5)
            job.id = 1
            engine._prepare([job])
            engine._step([job])
            return job
        finally:
            await engine.stop()

    job = asyncio.run(go())
    if distilled:
        assert job.uncond is None and seen[0]["rows"] == 1
        assert seen[0]["guidance"].tolist() == [3.5]
    else:
        assert job.uncond is not None and seen[0]["rows"] == 2 and seen[0]["guidance"] is None
