"""What the diffusers step engine needs to know about each pipeline family.

The engine owns the denoising loop (continuous batching between steps, per-request
seeds, cancel between steps); a family adapter says how one family does each part of
its own pipeline's `__call__`, using that pipeline's components and helpers:

- `encode(prompts)`: text conditioning, one tuple of tensors per prompt;
- `prepare(job)`: the starting noise from the job's own generator (as the pipeline's
  `prepare_latents` draws it) and the job's schedule;
- `key(job)`: jobs with equal keys share a transformer forward;
- `step(batch)`: one transformer forward over every row of the batch (a timestep per
  row; classifier-free guidance rows appended), then each job's scheduler step;
- `decode(jobs)`: latents to uint8 pixels, `[H, W, 3]` (image families) or
  `[frames, H, W, 3]` (video families).

Families: `FluxPipeline` (images; flow-matching Euler on packed latents, true CFG
unless the model is guidance-distilled — FLUX.1-dev takes the scale as its guidance
embedding — extra conditioning tokens for the world model), `StableDiffusion3Pipeline`
(images: SD3's three text encoders, CFG with a negative prompt), `WanPipeline` (Wan
2.1-style text-to-video: UMT5 text, 3-D latents, the scheduler of the directory — UniPC with
flow sigmas in the published checkpoints — one scheduler copy per request because
multistep schedulers keep state across steps), `LTXPipeline` (LTX-Video: packed
video latents, flow-matching Euler, rope scaled by the job's frame rate) and
`SkyReelsV2DiffusionForcingPipeline` (diffusion forcing: a long video chunk by chunk,
each chunk's frames conditioned on the clean latents of the frames before it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from omni_rt.engines.base import EngineError, EngineRequestError

if TYPE_CHECKING:
    from omni_rt.engines.diffusers_engine import DiffusionJob


class Family:
    """One pipeline family's parts of the denoising loop (see the module docstring)."""

    video = False  # decode gives [frames, H, W, 3]

    def __init__(self, pipe: Any, device: torch.device, max_sequence_length: int) -> None:
        self.pipe = pipe
        self.device = device
        self.max_sequence_length = max_sequence_length

    @property
    def size_multiple(self) -> int:
        raise NotImplementedError

    @property
    def frame_multiple(self) -> int:
        """A video family's clips are frame_multiple·k + 1 frames."""
        return 1

    @property
    def tokenizer(self) -> Any:
        """The tokenizer of the text encoder that `max_sequence_length` caps."""
        return self.pipe.tokenizer

    def check(self, job: DiffusionJob) -> None:
        """Refuse (EngineRequestError) what this family cannot produce."""
        m = self.size_multiple
        if job.height % m or job.width % m or job.height < m or job.width < m:
            raise EngineRequestError(f"height and width must be positive multiples of {m}, got {job.width}x{job.height}")
        self.check_frames(job)

    def check_frames(self, job: DiffusionJob) -> None:
        if not self.video:
            if job.frames != 1:
                raise EngineRequestError(f"{type(self.pipe).__name__} makes single images, not {job.frames} frames")
            return
        t = self.frame_multiple
        if job.frames < 1 or (job.frames - 1) % t:
            raise EngineRequestError(f"this model makes {t}k+1 frames (1, {t + 1}, {2 * t + 1}, …), got {job.frames}")

    def encode(self, prompts: list[str]) -> list[tuple[torch.Tensor, ...]]:
        raise NotImplementedError

    def uses_cfg(self, job: DiffusionJob) -> bool:
        """Whether the job runs classifier-free guidance (an unconditional row beside its own)."""
        return job.guidance_scale > 1.0

    def prepare(self, job: DiffusionJob) -> None:
        raise NotImplementedError

    def key(self, job: DiffusionJob) -> tuple[Any, ...]:
        return (job.frames, job.height, job.width, job.cfg)

    def step(self, batch: list[DiffusionJob]) -> None:
        raise NotImplementedError

    def decode(self, jobs: list[DiffusionJob]) -> list[np.ndarray]:
        raise NotImplementedError

    @staticmethod
    def guided(batch: list[DiffusionJob], out: torch.Tensor) -> list[torch.Tensor]:
        """Each job's prediction from the rows of one forward: rows are the batch in
        order, then the unconditional rows of the jobs with guidance in the same order."""
        n = len(batch)
        cfg_rows = {id(j): n + k for k, j in enumerate(b for b in batch if b.cfg)}
        preds = []
        for i, j in enumerate(batch):
            v = out[i]
            if j.cfg:
                u = out[cfg_rows[id(j)]]
                v = u + j.guidance_scale * (v - u)
            preds.append(v)
        return preds

    @staticmethod
    def rows(batch: list[DiffusionJob]) -> list[tuple[DiffusionJob, bool]]:
        """(job, unconditional) per row of one forward."""
        return [(j, False) for j in batch] + [(j, True) for j in batch if j.cfg]

    @staticmethod
    def text(rows: list[tuple[DiffusionJob, bool]], k: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Part `k` of each row's text conditioning (the negative prompt's for an
        unconditional row), stacked; in `dtype` when given."""
        out = torch.stack([(j.uncond if neg else j.cond)[k] for j, neg in rows])  # type: ignore[index]
        return out if dtype is None else out.to(dtype)

    def timesteps(self, rows: list[tuple[DiffusionJob, bool]]) -> torch.Tensor:
        """Each row's job's timestep at its current step (from its own scheduler copy)."""
        return torch.stack([j.state["timesteps"][j.step] for j, _ in rows]).to(self.device)

    def transformer_step(self, batch: list[DiffusionJob], conditioning: Callable[[list[tuple[DiffusionJob, bool]], torch.dtype], dict[str, Any]]) -> None:
        """One transformer forward over the batch's rows (their latents and timesteps,
        plus the keyword arguments `conditioning` builds from the rows and the
        transformer's dtype), then each job's scheduler step with its guided prediction."""
        tf = self.pipe.transformer
        rows = self.rows(batch)
        latents = torch.stack([j.latents for j, _ in rows]).to(tf.dtype)
        with torch.inference_mode():
            v = tf(hidden_states=latents, timestep=self.timesteps(rows), return_dict=False, **conditioning(rows, tf.dtype))[0].float()
        self.scheduler_steps(batch, self.guided(batch, v))

    @staticmethod
    def scheduler_steps(batch: list[DiffusionJob], preds: list[torch.Tensor]) -> None:
        """Each job's own scheduler copy takes its step with its prediction."""
        for j, v in zip(batch, preds, strict=True):
            with torch.inference_mode():
                j.latents = j.state["scheduler"].step(v[None], j.state["timesteps"][j.step], j.latents[None], return_dict=False)[0][0]  # type: ignore[index]
            j.step += 1

    @staticmethod
    def shift(config: Any, seq_len: int, max_shift: float) -> float:
        """The dynamic-shift `mu` for `seq_len` latent tokens, from a scheduler's config
        (`max_shift` is the pipeline's own default where the config has none)."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        return float(calculate_shift(seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                                     config.get("base_shift", 0.5), config.get("max_shift", max_shift)))


def _uint8(pixels: Any) -> np.ndarray:
    """Postprocessed pixels in [0, 1] -> uint8."""
    return (np.asarray(pixels) * 255).round().astype(np.uint8)


class FluxFamily(Family):
    def uses_cfg(self, job: DiffusionJob) -> bool:
        # a guidance-distilled Flux (FLUX.1-dev: `guidance_embeds`) takes the scale as its
        # guidance embedding, as FluxPipeline's `guidance_scale` does: one row, no negative
        # prompt (true CFG is the pipeline's separate `true_cfg_scale`)
        return not self.pipe.transformer.config.guidance_embeds and super().uses_cfg(job)

    @property
    def tokenizer(self) -> Any:
        return self.pipe.tokenizer_2  # T5's (CLIP's is capped at 77)

    @property
    def size_multiple(self) -> int:
        return 2 * int(self.pipe.vae_scale_factor)  # latents are packed 2x2

    def encode(self, prompts: list[str]) -> list[tuple[torch.Tensor, ...]]:
        with torch.inference_mode():
            embeds, pooled, _ids = self.pipe.encode_prompt(
                prompt=prompts, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length
            )
        return [(embeds[i], pooled[i]) for i in range(len(prompts))]

    def condition(self, job: DiffusionJob, cond: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        embeds, pooled = cond
        if job.context is not None:
            embeds = torch.cat([embeds, job.context.to(embeds.device, embeds.dtype)], dim=0)
        return embeds, pooled

    def prepare(self, job: DiffusionJob) -> None:
        pipe = self.pipe
        assert job.cond is not None
        job.cond = self.condition(job, job.cond)
        job.uncond = self.condition(job, job.uncond) if job.uncond is not None else None
        channels = pipe.transformer.config.in_channels // 4
        h = 2 * (job.height // self.size_multiple)
        w = 2 * (job.width // self.size_multiple)
        gen = torch.Generator(device="cpu").manual_seed(job.seed)
        noise = torch.randn((1, channels, h, w), generator=gen, dtype=torch.float32)
        job.latents = pipe._pack_latents(noise, 1, channels, h, w)[0].to(self.device)
        mu = self.shift(pipe.scheduler.config, job.latents.shape[0], 1.15)
        pipe.scheduler.set_timesteps(job.steps, device="cpu", sigmas=np.linspace(1.0, 1 / job.steps, job.steps), mu=mu)
        job.state["sigmas"] = [float(s) for s in pipe.scheduler.sigmas]  # steps + 1, ending at 0

    def key(self, job: DiffusionJob) -> tuple[Any, ...]:
        return (*super().key(job), 0 if job.context is None else int(job.context.shape[0]))

    def step(self, batch: list[DiffusionJob]) -> None:
        pipe = self.pipe
        first = batch[0]
        h = 2 * (first.height // self.size_multiple)
        w = 2 * (first.width // self.size_multiple)
        rows = self.rows(batch)
        dt = pipe.transformer.dtype
        latents = torch.stack([j.latents for j, _ in rows]).to(dt)
        sigma = torch.tensor([j.state["sigmas"][j.step] for j, _ in rows], dtype=torch.float32)
        embeds, pooled = self.text(rows, 0, dt), self.text(rows, 1, dt)
        img_ids = pipe._prepare_latent_image_ids(1, h // 2, w // 2, self.device, torch.float32)
        txt_ids = torch.zeros(embeds.shape[1], 3, dtype=torch.float32, device=self.device)
        guidance = None
        if pipe.transformer.config.guidance_embeds:
            guidance = torch.tensor([j.guidance_scale for j, _ in rows], dtype=torch.float32, device=self.device)
        with torch.inference_mode():
            v = pipe.transformer(
                hidden_states=latents,
                timestep=sigma.to(self.device, dt),  # the pipeline passes timestep / 1000 = sigma
                guidance=guidance,
                pooled_projections=pooled,
                encoder_hidden_states=embeds,
                txt_ids=txt_ids,
                img_ids=img_ids,
                return_dict=False,
            )[0].float()
        for j, vi in zip(batch, self.guided(batch, v), strict=True):
            # flow-matching Euler step, as FlowMatchEulerDiscreteScheduler.step
            sig = j.state["sigmas"]
            j.latents = j.latents + (sig[j.step + 1] - sig[j.step]) * vi
            j.step += 1

    def decode(self, jobs: list[DiffusionJob]) -> list[np.ndarray]:
        pipe = self.pipe
        images: dict[int, np.ndarray] = {}
        for (height, width), idx in _groups(jobs, lambda j: (j.height, j.width)).items():
            lat = torch.stack([jobs[i].latents for i in idx])
            lat = pipe._unpack_latents(lat, height, width, pipe.vae_scale_factor)
            lat = lat / pipe.vae.config.scaling_factor + (pipe.vae.config.shift_factor or 0.0)
            with torch.inference_mode():
                pixels = pipe.vae.decode(lat, return_dict=False)[0]
            arr = pipe.image_processor.postprocess(pixels, output_type="np")
            for i, a in zip(idx, arr, strict=True):
                images[i] = _uint8(a)
        return [images[i] for i in range(len(jobs))]


class Sd3Family(Family):
    """`StableDiffusion3Pipeline` (SD3 / SD3.5): two CLIP encoders and T5, unpacked
    latents `[C, h, w]`, flow-matching Euler (a scheduler copy per job), CFG with a
    negative prompt as the pipeline does it."""

    @property
    def size_multiple(self) -> int:
        return int(self.pipe.vae_scale_factor) * int(self.pipe.transformer.config.patch_size)

    @property
    def tokenizer(self) -> Any:
        return self.pipe.tokenizer_3  # T5's (the two CLIPs' are capped at 77)

    def encode(self, prompts: list[str]) -> list[tuple[torch.Tensor, ...]]:
        with torch.inference_mode():
            embeds, _neg, pooled, _neg_pooled = self.pipe.encode_prompt(
                prompt=prompts, prompt_2=None, prompt_3=None, device=self.device, do_classifier_free_guidance=False,
                max_sequence_length=self.max_sequence_length,
            )
        return [(embeds[i], pooled[i]) for i in range(len(prompts))]

    def prepare(self, job: DiffusionJob) -> None:
        pipe = self.pipe
        gen = torch.Generator(device="cpu").manual_seed(job.seed)
        lat = pipe.prepare_latents(1, pipe.transformer.config.in_channels, job.height, job.width, torch.float32, torch.device("cpu"), gen)
        job.latents = lat[0].to(self.device)
        sched = copy.deepcopy(pipe.scheduler)  # it counts its steps
        kwargs = {}
        if sched.config.get("use_dynamic_shifting"):
            p = int(pipe.transformer.config.patch_size)
            kwargs["mu"] = self.shift(sched.config, (job.latents.shape[1] // p) * (job.latents.shape[2] // p), 1.16)
        sched.set_timesteps(job.steps, device=self.device, **kwargs)
        job.state["scheduler"] = sched
        job.state["timesteps"] = list(sched.timesteps)

    def step(self, batch: list[DiffusionJob]) -> None:
        self.transformer_step(batch, lambda rows, dt: {"encoder_hidden_states": self.text(rows, 0, dt), "pooled_projections": self.text(rows, 1, dt)})

    def decode(self, jobs: list[DiffusionJob]) -> list[np.ndarray]:
        pipe = self.pipe
        vae = pipe.vae
        images: dict[int, np.ndarray] = {}
        for _size, idx in _groups(jobs, lambda j: (j.height, j.width)).items():
            lat = torch.stack([jobs[i].latents for i in idx]).to(vae.dtype)
            lat = lat / vae.config.scaling_factor + vae.config.shift_factor
            with torch.inference_mode():
                pixels = vae.decode(lat, return_dict=False)[0]
            for i, a in zip(idx, pipe.image_processor.postprocess(pixels, output_type="np"), strict=True):
                images[i] = _uint8(a)
        return [images[i] for i in range(len(jobs))]


class WanFamily(Family):
    video = True

    def __init__(self, pipe: Any, device: torch.device, max_sequence_length: int) -> None:
        super().__init__(pipe, device, max_sequence_length)
        if getattr(pipe, "transformer_2", None) is not None or pipe.config.get("boundary_ratio") is not None:
            raise EngineError("two-expert Wan 2.2 directories (transformer_2, boundary_ratio) are not supported by the step engine yet")
        if pipe.config.get("expand_timesteps"):
            raise EngineError("Wan directories with expand_timesteps (Wan 2.2 TI2V) are not supported by the step engine yet")

    @property
    def frame_multiple(self) -> int:
        return int(self.pipe.vae_scale_factor_temporal)

    @property
    def size_multiple(self) -> int:
        return int(self.pipe.vae_scale_factor_spatial) * int(self.pipe.transformer.config.patch_size[1])

    def encode(self, prompts: list[str]) -> list[tuple[torch.Tensor, ...]]:
        with torch.inference_mode():
            embeds, _neg = self.pipe.encode_prompt(
                prompt=prompts, do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length, device=self.device
            )
        return [(embeds[i],) for i in range(len(prompts))]

    def prepare(self, job: DiffusionJob) -> None:
        pipe = self.pipe
        gen = torch.Generator(device="cpu").manual_seed(job.seed)
        channels = pipe.transformer.config.in_channels
        lat = pipe.prepare_latents(1, channels, job.height, job.width, job.frames, torch.float32, torch.device("cpu"), gen)
        job.latents = lat[0].to(self.device)
        sched = copy.deepcopy(pipe.scheduler)  # multistep schedulers keep state per request
        sched.set_timesteps(job.steps, device=self.device)
        sched.set_begin_index(0)
        job.state["scheduler"] = sched
        job.state["timesteps"] = list(sched.timesteps)

    def step(self, batch: list[DiffusionJob]) -> None:
        self.transformer_step(batch, lambda rows, dt: {"encoder_hidden_states": self.text(rows, 0, dt)})

    def decode(self, jobs: list[DiffusionJob]) -> list[np.ndarray]:
        pipe = self.pipe
        vae = pipe.vae
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)
        out: dict[int, np.ndarray] = {}
        for _shape, idx in _groups(jobs, lambda j: (j.frames, j.height, j.width)).items():
            lat = torch.stack([jobs[i].latents for i in idx]).to(self.device, vae.dtype)
            lat = lat * std.to(lat) + mean.to(lat)  # the pipeline's latents / (1 / std) + mean
            with torch.inference_mode():
                video = vae.decode(lat, return_dict=False)[0]
            arr = pipe.video_processor.postprocess_video(video, output_type="np")  # [B, F, H, W, 3] in [0, 1]
            for i, a in zip(idx, arr, strict=True):
                out[i] = _uint8(a)
        return [out[i] for i in range(len(jobs))]


class ForcingFamily(WanFamily):
    """`SkyReelsV2DiffusionForcingPipeline` (SkyReels-V2 DF): Wan's parts plus a
    timestep per latent frame. A job is one chunk of a long video: `prefix` (latents
    `[C, P, h, w]` of the frames before it, clean, never updated) followed by the new
    latent frames, which the pipeline's own `generate_timestep_matrix` schedules (one
    scheduler copy per latent frame, as the pipeline keeps them). A job without a
    prefix makes `4k+1` frames (the start of a video); with one, `4k` new frames, and
    decoding returns only those (decoded after the prefix's last `decode_context`
    latent frames rather than the whole prefix). Its `latents` (all of the chunk's,
    prefix first) are what the next chunk takes its prefix from. `context` tokens
    `[T, text_dim]` (a world model's action) join the text tokens."""

    def check_frames(self, job: DiffusionJob) -> None:
        t = self.frame_multiple
        if job.prefix is None:
            if job.frames < 1 or (job.frames - 1) % t:
                raise EngineRequestError(f"the first chunk of a video is {t}k+1 frames (1, {t + 1}, {2 * t + 1}, …), got {job.frames}")
        else:
            if job.frames < t or job.frames % t:
                raise EngineRequestError(f"a chunk after the first is {t}k frames ({t}, {2 * t}, …), got {job.frames}")
            c, _p, h, w = job.prefix.shape
            s = int(self.pipe.vae_scale_factor_spatial)
            if (c, h, w) != (self.pipe.transformer.config.in_channels, job.height // s, job.width // s):
                raise EngineRequestError(f"the prefix latents {list(job.prefix.shape)} do not fit a {job.width}x{job.height} clip")

    def new_latent_frames(self, job: DiffusionJob) -> int:
        t = self.frame_multiple
        return job.frames // t if job.prefix is not None else (job.frames - 1) // t + 1

    def prefix_frames(self, job: DiffusionJob) -> int:
        return 0 if job.prefix is None else int(job.prefix.shape[1])

    def key(self, job: DiffusionJob) -> tuple[Any, ...]:
        start, end = job.state["intervals"][job.step] if "intervals" in job.state else (0, 0)
        extra = 0 if job.context is None else int(job.context.shape[0])
        return (*Family.key(self, job), end - start, 0 if job.fps == 16 else 1, extra)

    def prepare(self, job: DiffusionJob) -> None:
        pipe = self.pipe
        if job.context is not None:  # extra conditioning tokens (a world model's action) beside the text's
            assert job.cond is not None
            job.cond = (torch.cat([job.cond[0], job.context.to(job.cond[0])], dim=0),)
            if job.uncond is not None:
                job.uncond = (torch.cat([job.uncond[0], job.context.to(job.uncond[0])], dim=0),)
        p = self.prefix_frames(job)
        frames = p + self.new_latent_frames(job)
        s = int(pipe.vae_scale_factor_spatial)
        gen = torch.Generator(device="cpu").manual_seed(job.seed)
        shape = (1, pipe.transformer.config.in_channels, frames, job.height // s, job.width // s)
        lat = torch.randn(shape, generator=gen, dtype=torch.float32)[0]  # as prepare_latents draws it (randn_tensor)
        if job.prefix is not None:
            lat[:, :p] = job.prefix.to(lat)
        job.latents = lat.to(self.device)
        schedulers = []
        for _ in range(frames):
            f = copy.deepcopy(pipe.scheduler)
            f.set_timesteps(job.steps, device=self.device)
            schedulers.append(f)
        block = int(pipe.transformer.config.num_frame_per_block)
        matrix, _index, update, intervals = pipe.generate_timestep_matrix(frames, schedulers[0].timesteps, frames, 0, p, block)
        job.state.update(schedulers=schedulers, matrix=matrix, update=update, intervals=intervals)
        job.steps = len(matrix)

    def step(self, batch: list[DiffusionJob]) -> None:
        tf = self.pipe.transformer
        rows = self.rows(batch)
        start, end = batch[0].state["intervals"][batch[0].step]
        for j in batch:
            assert tuple(j.state["intervals"][j.step]) == (start, end)  # the batch key holds the window's length
        windows = []
        steps = []
        for j, _ in rows:
            s, e = j.state["intervals"][j.step]
            windows.append(j.latents[:, s:e])  # type: ignore[index]
            steps.append(j.state["matrix"][j.step][s:e])
        latents = torch.stack(windows).to(tf.dtype)
        timestep = torch.stack(steps).to(self.device)
        embeds = self.text(rows, 0, tf.dtype)
        # the rows share one frame-rate class (the batch key holds it): diffusers' SkyReels-V2
        # transformer adds its fps embedding (checkpoints with `inject_sample_info`) to every
        # row from one entry in diffusion-forcing mode, and fails to broadcast one per row
        fps = [0 if batch[0].fps == 16 else 1]
        with torch.inference_mode():
            v = tf(hidden_states=latents, timestep=timestep, encoder_hidden_states=embeds, enable_diffusion_forcing=True, fps=fps,
                   return_dict=False)[0].float()
        for j, vi in zip(batch, self.guided(batch, v), strict=True):
            s, e = j.state["intervals"][j.step]
            t, update = j.state["matrix"][j.step], j.state["update"][j.step]
            lat = j.latents
            assert lat is not None
            with torch.inference_mode():
                for idx in range(s, e):
                    if bool(update[idx]):
                        lat[:, idx] = j.state["schedulers"][idx].step(vi[:, idx - s][None], t[idx], lat[:, idx][None], return_dict=False)[0][0]
            j.step += 1

    # latent frames of the prefix decoded with a chunk (the VAE decodes causally in time:
    # the new frames are decoded after this much of what came before them)
    decode_context = 1

    def decode(self, jobs: list[DiffusionJob]) -> list[np.ndarray]:
        full: dict[int, torch.Tensor] = {}
        for j in jobs:  # a chunk after the first: its prefix decodes to frames already shown
            if j.prefix is not None and j.latents is not None:
                full[id(j)] = j.latents
                j.latents = j.latents[:, max(0, self.prefix_frames(j) - self.decode_context) :]
        try:
            clips = super().decode(jobs)
        finally:
            for j in jobs:
                if id(j) in full:
                    j.latents = full[id(j)]
        return [c[-j.frames :] if j.prefix is not None else c for j, c in zip(jobs, clips, strict=True)]


class LtxFamily(Family):
    """`LTXPipeline` (LTX-Video): T5 text with its attention mask, packed video latents
    `[tokens, channels]`, flow-matching Euler (a scheduler copy per job: it counts its
    steps), rope scaled by the job's frame rate, the VAE's own latent statistics."""

    video = True

    @property
    def frame_multiple(self) -> int:
        return int(self.pipe.vae_temporal_compression_ratio)

    @property
    def size_multiple(self) -> int:
        return int(self.pipe.vae_spatial_compression_ratio) * int(self.pipe.transformer_spatial_patch_size)

    def latent_shape(self, job: DiffusionJob) -> tuple[int, int, int]:
        pipe = self.pipe
        s = pipe.vae_spatial_compression_ratio
        return (job.frames - 1) // pipe.vae_temporal_compression_ratio + 1, job.height // s, job.width // s

    def key(self, job: DiffusionJob) -> tuple[Any, ...]:
        return (*super().key(job), job.fps)

    def encode(self, prompts: list[str]) -> list[tuple[torch.Tensor, ...]]:
        with torch.inference_mode():
            embeds, mask, _neg, _neg_mask = self.pipe.encode_prompt(
                prompt=prompts, do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length, device=self.device
            )
        return [(embeds[i], mask[i]) for i in range(len(prompts))]

    def prepare(self, job: DiffusionJob) -> None:
        pipe = self.pipe
        gen = torch.Generator(device="cpu").manual_seed(job.seed)
        lat = pipe.prepare_latents(1, pipe.transformer.config.in_channels, job.height, job.width, job.frames, torch.float32, torch.device("cpu"), gen)
        job.latents = lat[0].to(self.device)
        f, h, w = self.latent_shape(job)
        mu = self.shift(pipe.scheduler.config, f * h * w, 1.15)
        sched = copy.deepcopy(pipe.scheduler)
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / job.steps, job.steps), device=self.device, mu=mu)
        job.state["scheduler"] = sched
        job.state["timesteps"] = list(sched.timesteps)

    def step(self, batch: list[DiffusionJob]) -> None:
        pipe = self.pipe
        f, h, w = self.latent_shape(batch[0])
        scale = (pipe.vae_temporal_compression_ratio / batch[0].fps, pipe.vae_spatial_compression_ratio, pipe.vae_spatial_compression_ratio)
        self.transformer_step(batch, lambda rows, dt: {
            "encoder_hidden_states": self.text(rows, 0, dt), "encoder_attention_mask": self.text(rows, 1),
            "num_frames": f, "height": h, "width": w, "rope_interpolation_scale": scale,
        })

    def decode(self, jobs: list[DiffusionJob]) -> list[np.ndarray]:
        pipe = self.pipe
        vae = pipe.vae
        out: dict[int, np.ndarray] = {}
        for _shape, idx in _groups(jobs, lambda j: (j.frames, j.height, j.width)).items():
            f, h, w = self.latent_shape(jobs[idx[0]])
            lat = torch.stack([jobs[i].latents for i in idx])
            lat = pipe._unpack_latents(lat, f, h, w, pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
            lat = pipe._denormalize_latents(lat, vae.latents_mean, vae.latents_std, vae.config.scaling_factor).to(vae.dtype)
            # a timestep-conditioned VAE decodes at the pipeline's default decode_timestep, 0 (no noise mixed in)
            timestep = torch.zeros(len(idx), device=self.device, dtype=lat.dtype) if vae.config.timestep_conditioning else None
            with torch.inference_mode():
                video = vae.decode(lat, timestep, return_dict=False)[0]
            arr = pipe.video_processor.postprocess_video(video, output_type="np")
            for i, a in zip(idx, arr, strict=True):
                out[i] = _uint8(a)
        return [out[i] for i in range(len(jobs))]


def _groups(jobs: list[DiffusionJob], key: Any) -> dict[Any, list[int]]:
    by: dict[Any, list[int]] = {}
    for i, j in enumerate(jobs):
        by.setdefault(key(j), []).append(i)
    return by


FAMILIES: dict[str, type[Family]] = {
    "FluxPipeline": FluxFamily,
    "StableDiffusion3Pipeline": Sd3Family,
    "WanPipeline": WanFamily,
    "LTXPipeline": LtxFamily,
    "SkyReelsV2DiffusionForcingPipeline": ForcingFamily,
}
