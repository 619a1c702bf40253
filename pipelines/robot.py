"""The `robot` pipeline: one policy stage mapping observations to action chunks, on π0.

The policy is transformers' `PI0ForConditionalGeneration` (a PaliGemma prefix over the
cameras and the prompt, a Gemma action expert that predicts the flow-matching velocity
of a noisy action chunk, integrated from noise at t = 1 to actions at t = 0), loaded
with `from_pretrained` from a directory: a transformers-saved π0 or a lerobot one
(`lerobot/pi0_base` and its fine-tunes: lerobot's config.json and key names, which
transformers maps itself). Nothing of the network is written here: the engine module
(`Pi0Steps`) calls the model's own `embed_prefix`, its VLM and its forward.

- Inputs follow the checkpoint's processor: `PI0Processor` with the directory's
  tokenizer and image-processor settings (`processor_config.json` or
  `preprocessor_config.json`; `processor_args.processor` names another directory, e.g.
  PaliGemma's, when the policy directory has none), the image processor run on PIL
  (`Pi0ImageProcessor`: the same resize and normalisation without torchvision). The
  prompt is padded to a fixed length (`max_prompt_tokens`), so robots of one layout
  share one prefix length and so one batch.
- Normalisation from the checkpoint (`load_normalization`): lerobot's normalizer files
  (`policy_preprocessor.json` / `policy_postprocessor.json` and the safetensors of
  statistics they name: MEAN_STD, MIN_MAX, QUANTILES or IDENTITY per feature type) or
  `PI0Processor`'s `state_mean`/`state_std`/`actions_mean`/`actions_std`; none means
  the model's raw values.
- Layouts (`processor_args.layouts`) map an embodiment onto the model: which
  observation keys are the cameras (in order), which are concatenated into the state,
  the prompt key, how many action dims the robot takes and (optionally) how many of
  the chunk's steps. A connection picks one (`?layout=aloha`), else `default_layout`.
- Continuous batching at step level: a request's prefix (images, prompt, state) is
  encoded once and its KV cache kept for the request; each Euler step of the action
  expert is one item on the torch engine, so robots that arrive mid-inference join the
  next step's batch, at whatever step each one is. The KV cache, the state and the
  noisy actions stay on the engine's device between steps (tensors in, tensors out).
  Each request's noise comes from its own generator (episode seed, step), so a batched
  result equals the unbatched one.
- Episode state (the step counter that seeds the noise and the previous chunk's last
  action, which chunk-boundary smoothing blends toward) lives in the robot's session:
  it comes in as `params["episode"]` and the updated state goes back on the action
  payload's `meta["episode"]`. Nothing is shared between robots.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import Field
from transformers.image_processing_backends import PilBackend
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling

from omni_rt.engines.base import Engine, StepEngine
from omni_rt.payloads import Payload, PayloadKind
from omni_rt.specs import StageSpec
from omni_rt.stage import ProcessorArgs, StageContext, StageError, StageProcessor
from pipelines import checkpoint

ARCHITECTURE = "PI0ForConditionalGeneration"
# What the processor pads the prompt to (PI0Processor's own default max_length): the
# BOS, the prompt's tokens and the newline after it.
DEFAULT_PROMPT_TOKENS = 48
PREPROCESSOR = "policy_preprocessor.json"
POSTPROCESSOR = "policy_postprocessor.json"


class Pi0ImageProcessor(PilBackend):
    """`PI0ImageProcessor`'s defaults on transformers' PIL backend (the class itself
    needs torchvision). The checkpoint's image-processor settings override them."""

    resample = PILImageResampling.BICUBIC
    image_mean = IMAGENET_STANDARD_MEAN
    image_std = IMAGENET_STANDARD_STD
    size = {"max_height": 224, "max_width": 224}
    default_to_square = False
    do_resize = True
    do_rescale = True
    do_normalize = True
    do_convert_rgb = True
    pad_size = {"height": 224, "width": 224}
    do_pad = True


class Pi0Steps(torch.nn.Module):
    """The torch engine's module: transformers' π0 with the denoising loop of its
    `sample_actions` cut at step granularity. `encode` runs the prefix once and returns
    its KV cache (one tensor [layers, 2, kv_heads, prefix, head_dim] per request, so
    requests stack along the batch); `denoise` is one Euler step for a batch of
    requests, each at its own time t."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.pi0 = model

    @classmethod
    def load(cls, model_dir: str) -> Pi0Steps:
        from transformers import PI0ForConditionalGeneration

        return cls(PI0ForConditionalGeneration.from_pretrained(model_dir).eval())

    def _dtype(self) -> torch.dtype:
        return next(self.pi0.parameters()).dtype

    def encode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        pixel_values: torch.Tensor,
        pixel_attention_mask: torch.Tensor,
        state: torch.Tensor,
        noise: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        model = self.pi0.model
        embeds = model.embed_prefix(input_ids, pixel_values.to(self._dtype()), pixel_attention_mask)
        cache = model.vlm(
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            position_ids=attention_mask.cumsum(-1) - 1,
            token_type_ids=torch.zeros_like(embeds)[:, :, 0],
            use_cache=True,
            return_dict=True,
        ).past_key_values
        kv = torch.stack([torch.stack([layer.keys, layer.values], 1) for layer in cache.layers], 1)
        # state and noise ride along so that they, too, live on the device from here on
        return {"kv": kv, "attention_mask": attention_mask, "state": state, "x": noise}

    def denoise(
        self, kv: torch.Tensor, attention_mask: torch.Tensor, state: torch.Tensor, x: torch.Tensor, t: torch.Tensor, dt: torch.Tensor
    ) -> torch.Tensor:
        from transformers import DynamicCache

        # A cache over the batch's prefixes; the step's own keys are appended to copies
        # (torch.cat), so the request's prefix KV is never changed.
        cache = DynamicCache(ddp_cache_data=[(kv[:, i, 0], kv[:, i, 1]) for i in range(kv.shape[1])])
        dtype = self._dtype()
        v = self.pi0(
            state=state.to(dtype), noise=x.to(dtype), timestep=t, attention_mask=attention_mask, past_key_values=cache
        ).logits
        return x + dt[:, None, None] * v.float()


# ---- normalisation from the checkpoint ---------------------------------------------------


@dataclass(frozen=True)
class Norm:
    """One feature's normalisation, as lerobot's normalizer steps define it."""

    mode: str  # MEAN_STD, MIN_MAX, QUANTILES (q01..q99 to -1..1), IDENTITY
    stats: Mapping[str, np.ndarray]
    eps: float
    source: str  # the file the statistics came from
    feature: str

    MODES = {"MEAN_STD": ("mean", "std"), "MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"), "IDENTITY": ()}

    @property
    def dim(self) -> int | None:
        return None if self.mode == "IDENTITY" else int(next(iter(self.stats.values())).shape[-1])

    def _lo_scale(self) -> tuple[np.ndarray, np.ndarray]:
        a, b = (self.stats[k] for k in self.MODES[self.mode])
        if self.mode == "MEAN_STD":
            return a, b + self.eps
        return a, (b - a + self.eps) / 2.0  # [lo, hi] -> [-1, 1]

    def normalize(self, x: np.ndarray) -> np.ndarray:
        if self.mode == "IDENTITY":
            return x
        lo, scale = self._lo_scale()
        y = (x - lo) / scale
        return (y if self.mode == "MEAN_STD" else y - 1.0).astype(np.float32)

    def unnormalize(self, y: np.ndarray) -> np.ndarray:
        if self.mode == "IDENTITY":
            return y
        lo, scale = self._lo_scale()
        return ((y if self.mode == "MEAN_STD" else y + 1.0) * scale + lo).astype(np.float32)

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "feature": self.feature, "dims": self.dim, "source": self.source}


def _normalizer_step(path: Path, registry_name: str) -> tuple[dict[str, Any], Mapping[str, np.ndarray]] | None:
    """The named step of a lerobot processor file and the statistics its state file holds."""
    from safetensors.numpy import load_file

    conf = checkpoint.config(str(path.parent), path.name)
    steps = conf.get("steps")
    if not isinstance(steps, list):
        raise StageError(f"{path}: a processor file has a list of steps")
    for step in steps:
        if isinstance(step, dict) and step.get("registry_name") == registry_name:
            stats: Mapping[str, np.ndarray] = {}
            if step.get("state_file"):
                state = path.parent / str(step["state_file"])
                if not state.is_file():
                    raise StageError(f"{path}: its {registry_name} names the statistics file {state.name}, which is missing")
                stats = {k: np.asarray(v, np.float32) for k, v in load_file(str(state)).items()}
            return dict(step.get("config") or {}), stats
    return None


def _lerobot_norm(path: Path, registry_name: str, kind: str) -> Norm | None:
    found = _normalizer_step(path, registry_name)
    if found is None:
        return None
    conf, stats = found
    features = conf.get("features") or {}
    names = [n for n, f in features.items() if isinstance(f, dict) and f.get("type") == kind]
    if not names:
        return None
    mode = str((conf.get("norm_map") or {}).get(kind, "IDENTITY")).upper()
    if mode not in Norm.MODES:
        raise StageError(f"{path}: normalisation mode {mode!r} for {kind} is not one of {sorted(Norm.MODES)}")
    feature = names[0]
    needed = {k: stats.get(f"{feature}.{k}") for k in Norm.MODES[mode]}
    missing = [f"{feature}.{k}" for k, v in needed.items() if v is None]
    if missing:
        raise StageError(f"{path}: {mode} for {feature} needs the statistics {', '.join(missing)}, not in its state file")
    return Norm(mode, {k: v for k, v in needed.items() if v is not None}, float(conf.get("eps", 1e-8)), path.name, feature)


def load_normalization(model_dir: str, processor_config: Mapping[str, Any]) -> tuple[Norm | None, Norm | None]:
    """(state, actions) normalisation a checkpoint declares, None where it declares none."""
    d = Path(model_dir)
    state = actions = None
    if (d / PREPROCESSOR).is_file():
        state = _lerobot_norm(d / PREPROCESSOR, "normalizer_processor", "STATE")
        actions = _lerobot_norm(d / PREPROCESSOR, "normalizer_processor", "ACTION")
    if (d / POSTPROCESSOR).is_file():
        actions = _lerobot_norm(d / POSTPROCESSOR, "unnormalizer_processor", "ACTION") or actions
    # PI0Processor's own statistics (it normalises with (x - mean) / (std + 1e-8))
    for key, name in (("state", "state"), ("actions", "actions")):
        mean, std = processor_config.get(f"{key}_mean"), processor_config.get(f"{key}_std")
        if mean is None or std is None:
            continue
        stats = {"mean": np.asarray(mean, np.float32), "std": np.asarray(std, np.float32)}
        if stats["mean"].shape != stats["std"].shape or stats["mean"].ndim != 1:
            raise StageError(f"{d / 'processor_config.json'}: {key}_mean and {key}_std must be lists of one length")
        norm = Norm("MEAN_STD", stats, 1e-8, "processor_config.json", name)
        if key == "state":
            state = state or norm
        else:
            actions = actions or norm
    return state, actions


# ---- the checkpoint's processor ---------------------------------------------------------


def image_processor_config(processor_dir: str) -> dict[str, Any]:
    """The image processor's settings: `processor_config.json`'s `image_processor`
    (how transformers 5 saves a processor) or `preprocessor_config.json`."""
    conf = checkpoint.config(processor_dir, "processor_config.json").get("image_processor")
    if not isinstance(conf, dict):
        conf = checkpoint.config(processor_dir, "preprocessor_config.json")
    if not conf:
        raise StageError(
            f"policy processor {processor_dir}: no image processor settings (processor_config.json with an "
            f"image_processor, or preprocessor_config.json); processor_args.processor can name a directory that has them"
        )
    size = conf.get("size")
    if not (isinstance(size, dict) and size.get("height") and size.get("width")):
        raise StageError(f"policy processor {processor_dir}: the image processor's size must give height and width, got {size!r}")
    if not conf.get("image_seq_length"):
        raise StageError(f"policy processor {processor_dir}: the image processor's settings lack image_seq_length")
    return conf


def load_processor(processor_dir: str) -> Any:
    from transformers import AutoTokenizer, PI0Processor

    conf = {k: v for k, v in image_processor_config(processor_dir).items() if k not in ("image_processor_type", "processor_class")}
    # A PaliGemma folder's SigLIP settings say nothing of padding: images are padded to
    # the size they are resized to (π0's own default, 224, is that size at 224).
    conf.setdefault("pad_size", dict(conf["size"]))
    checkpoint.check_tokenizer_files(processor_dir, "policy processor")
    extra = checkpoint.config(processor_dir, "processor_config.json")
    kwargs = {k: extra[k] for k in ("state_mean", "state_std", "actions_mean", "actions_std", "max_state_dim", "chunk_size") if k in extra}
    return PI0Processor(image_processor=Pi0ImageProcessor(**conf), tokenizer=AutoTokenizer.from_pretrained(processor_dir), **kwargs)


def check_embeddable(tokenizer: Any, vocab_size: int, replaced: set[int], where: str) -> None:
    """Refuse a tokenizer that can emit an id the model would look up past its embedding
    table. Ids in `replaced` never reach the table (π0 replaces its image token's
    positions with the vision tower's features, as PaliGemma does: PaliGemma's tokenizer
    has 257,152 pieces plus `<image>` at id 257152, and π0 embeds 257,152)."""
    n = len(tokenizer)
    if n <= vocab_size:
        return
    over = sorted((i, t) for t, i in tokenizer.get_vocab().items() if i >= vocab_size and i not in replaced)
    if over:
        shown = ", ".join(f"{t!r} (id {i})" for i, t in over[:5]) + (f" and {len(over) - 5} more" if len(over) > 5 else "")
        raise ValueError(
            f"{where}: {n} tokens, the model embeds {vocab_size}: {shown} would be looked up past the embedding table "
            f"(a tokenizer of another model?)"
        )


def pi0_config(model_dir: str) -> dict[str, Any]:
    """config.json of a π0 directory (transformers' or lerobot's), refused if it is not one."""
    conf = checkpoint.config(model_dir)
    if not conf:
        raise StageError(f"policy {model_dir}: config.json missing")
    kind = conf.get("model_type") or conf.get("type")  # transformers' and lerobot's configs
    arch = [str(a) for a in conf.get("architectures") or []]
    if kind != "pi0" or (arch and ARCHITECTURE not in arch):
        raise StageError(
            f"policy {model_dir}: config.json describes {arch[0] if arch else repr(kind)}, not π0 "
            f"({ARCHITECTURE}: model_type or lerobot type 'pi0')"
        )
    return conf


def check_policy_dir(model_dir: str, processor_dir: str | None = None) -> dict[str, Any]:
    """Refuse a directory that is not a π0 this stage can load, from its config,
    processor and statistics files alone (no weights); returns its config.json."""
    conf = pi0_config(model_dir)
    image_processor_config(processor_dir or model_dir)
    checkpoint.check_tokenizer_files(processor_dir or model_dir, "policy processor")
    load_normalization(model_dir, {})  # names a missing statistics file
    return conf


# ---- layouts (per-embodiment input/output transforms) ----------------------------------


class LayoutArgs(ProcessorArgs):
    """One embodiment's layout (`processor_args.layouts.<name>`): which observation keys
    are its cameras and state, how many dims each state key has, its action dims and
    horizon (the checkpoint's bounds are checked when the layout meets the policy)."""

    images: tuple[str, ...] = Field(default=(), description="the observation keys of its cameras (at least one)")
    state: tuple[str, ...] = Field(default=(), description="the observation keys of its state vectors")
    state_dims: tuple[int, ...] = Field(default=(), description="the dims of each state key, in order")
    action_dim: int = Field(description="action dims (1..the policy's max_action_dim)")
    action_horizon: int | None = Field(default=None, description="actions per chunk (1..the policy's chunk_size; default: chunk_size)")
    prompt: str = Field(default="prompt", description="the observation key of the instruction")
    default_prompt: str = Field(default="", description="the instruction when an observation has none")


class PolicyArgs(ProcessorArgs):
    layouts: dict[str, LayoutArgs] = Field(default={}, description="embodiment name -> its layout (at least one)")
    default_layout: str | None = Field(default=None, description="the layout of a robot that names none (default: the first)")
    num_steps: int | None = Field(default=None, ge=1, description="denoising steps (default: the checkpoint's num_inference_steps)")
    smoothing: float = Field(default=0.5, ge=0.0, lt=1.0, description="how much of the previous chunk's last action the next one keeps")
    seed: int = Field(default=0, description="a robot's noise seed when its episode names none")
    processor: str | None = Field(default=None, description="a directory with the tokenizer and image settings, when the policy's has none")
    max_prompt_tokens: int | None = Field(default=None, ge=2, description="prompt tokens (default: the checkpoint's tokenizer_max_length)")


@dataclass(frozen=True)
class Layout:
    name: str
    images: tuple[str, ...]
    state: tuple[str, ...]
    state_dims: tuple[int, ...]
    action_dim: int
    action_horizon: int
    prompt: str = "prompt"
    default_prompt: str = ""

    @classmethod
    def of(cls, name: str, args: LayoutArgs, config: Any) -> Layout:
        """A layout's args against the policy's bounds."""
        lay = cls(name=name, images=args.images, state=args.state, state_dims=args.state_dims, action_dim=args.action_dim,
                  action_horizon=config.chunk_size if args.action_horizon is None else args.action_horizon,
                  prompt=args.prompt, default_prompt=args.default_prompt)
        if not lay.images:
            raise ValueError(f"layouts.{name}: at least one camera (images) is needed")
        if len(lay.state) != len(lay.state_dims) or any(d < 1 for d in lay.state_dims):
            raise ValueError(f"layouts.{name}: state and state_dims must pair up, each dim >= 1")
        if sum(lay.state_dims) > config.max_state_dim:
            raise ValueError(f"layouts.{name}: state of {sum(lay.state_dims)} dims exceeds the policy's max_state_dim {config.max_state_dim}")
        if not 1 <= lay.action_dim <= config.max_action_dim:
            raise ValueError(f"layouts.{name}: action_dim must be in 1..{config.max_action_dim} (the policy's max_action_dim)")
        if not 1 <= lay.action_horizon <= config.chunk_size:
            raise ValueError(f"layouts.{name}: action_horizon must be in 1..{config.chunk_size} (the policy's chunk_size)")
        return lay


def _image(name: str, arr: np.ndarray) -> np.ndarray:
    """An HWC or CHW camera image (uint8, or float in [0, 1]) -> uint8 HWC RGB."""
    if arr.ndim != 3 or 3 not in (arr.shape[0], arr.shape[-1]):
        raise StageError(f"observation {name!r}: expected an RGB image [H, W, 3] or [3, H, W], got shape {list(arr.shape)}")
    if arr.shape[-1] != 3:
        arr = arr.transpose(1, 2, 0)
    if arr.dtype != np.uint8:
        if arr.dtype.kind != "f":
            raise StageError(f"observation {name!r}: images are uint8 (or float in [0, 1]), got {arr.dtype}")
        if not np.isfinite(arr).all():
            raise StageError(f"observation {name!r}: image has NaN or infinite values")
        arr = (np.clip(arr, 0.0, 1.0) * 255.0).round().astype(np.uint8)
    h, w = arr.shape[:2]
    if h < 1 or w < 1 or max(h, w) > 4096:
        raise StageError(f"observation {name!r}: image side must be 1..4096 pixels, got {h}x{w}")
    return np.ascontiguousarray(arr)


class PolicyProcessor(StageProcessor):
    """Entry stage: one OBSERVATION payload in, one ACTIONS payload out per request."""

    @staticmethod
    def torch_module(model_dir: str, role: str) -> Callable[[], torch.nn.Module]:
        return lambda: Pi0Steps.load(model_dir)

    @classmethod
    def check_spec(cls, spec: StageSpec) -> None:
        assert spec.model is not None
        args = PolicyArgs.parse(spec.processor_args, "policy processor_args")
        check_policy_dir(spec.model, args.processor)

    def __init__(self, spec: StageSpec, engine: Engine | None, aux: Mapping[str, Engine]) -> None:
        from transformers import PI0Config

        super().__init__(spec, engine, aux)
        self.steps = self.engine_as(StepEngine)
        assert spec.model is not None
        args = PolicyArgs.parse(spec.processor_args, "policy processor_args")
        processor_dir = args.processor or spec.model
        raw = pi0_config(spec.model)  # the loads below refuse missing processor and statistics files
        self.config = PI0Config.from_pretrained(spec.model)
        self.name = str(raw.get("name") or raw.get("_name_or_path") or Path(spec.model).name)
        self.processor = load_processor(processor_dir)
        vlm = self.config.vlm_config
        if self.processor.image_token_id != vlm.image_token_id:
            raise ValueError(
                f"policy processor {processor_dir}: its <image> token is id {self.processor.image_token_id}, the model's "
                f"image_token_id is {vlm.image_token_id} (a tokenizer of another model?)"
            )
        check_embeddable(self.processor.tokenizer, int(vlm.text_config.vocab_size), {int(vlm.image_token_id)}, f"policy processor {processor_dir}")
        self.state_norm, self.action_norm = load_normalization(spec.model, checkpoint.config(processor_dir, "processor_config.json"))
        self.layouts = {n: Layout.of(n, la, self.config) for n, la in args.layouts.items()}
        if not self.layouts:
            raise ValueError("policy processor_args.layouts: at least one layout is needed")
        for lay in self.layouts.values():
            self._check_against_stats(lay)
        self.default_layout = args.default_layout or next(iter(self.layouts))
        if self.default_layout not in self.layouts:
            raise ValueError(f"default_layout {self.default_layout!r} is not one of {sorted(self.layouts)}")
        self.num_steps = args.num_steps or int(self.config.num_inference_steps)
        self.smoothing = args.smoothing
        self.seed = args.seed
        self.max_prompt_tokens = args.max_prompt_tokens or int(raw.get("tokenizer_max_length", DEFAULT_PROMPT_TOKENS))
        if self.num_steps < 1 or self.max_prompt_tokens < 2:
            raise ValueError(f"policy {spec.model}: the checkpoint's num_inference_steps ({self.num_steps}) must be >= 1 and its "
                             f"tokenizer_max_length ({self.max_prompt_tokens}) >= 2")
        self.size = (int(self.processor.height), int(self.processor.width))
        self.image_tokens = int(self.processor.image_seq_length)
        vision = vlm.vision_config
        side = int(vision.image_size)
        if self.size != (side, side) or self.image_tokens != (side // int(vision.patch_size)) ** 2:
            raise ValueError(
                f"policy processor {processor_dir}: its images are {self.size[0]}x{self.size[1]} of {self.image_tokens} tokens, the "
                f"model's vision tower takes {side}x{side} of {(side // int(vision.patch_size)) ** 2} (a processor of another resolution?)"
            )
        # One processor per layout: a fast tokenizer keeps its padding length as state
        # that each call sets, so concurrent calls padding to different lengths (layouts
        # with other camera counts) must not share one.
        self._processors = {name: copy.deepcopy(self.processor) for name in self.layouts}

    def _check_against_stats(self, lay: Layout) -> None:
        for norm, dims, what in ((self.state_norm, sum(lay.state_dims), "state"), (self.action_norm, lay.action_dim, "action_dim")):
            if norm is not None and norm.dim is not None and norm.dim != dims:
                raise ValueError(
                    f"layouts.{lay.name}: {what} of {dims} dims, but the checkpoint normalises {norm.feature} with "
                    f"{norm.dim} ({norm.source}); serve only layouts of the embodiment it was trained on"
                )

    # ---- what a client is told first ---------------------------------------------------
    def layout(self, name: str | None) -> Layout:
        lay = self.layouts.get(name or self.default_layout)
        if lay is None:
            raise KeyError(f"unknown layout {name!r}; this policy serves: {', '.join(sorted(self.layouts))}")
        return lay

    def metadata(self, name: str | None) -> dict[str, Any]:
        lay = self.layout(name)
        return {
            "policy": self.name,
            "architecture": ARCHITECTURE,
            "layout": lay.name,
            "layouts": sorted(self.layouts),
            "action_horizon": lay.action_horizon,
            "chunk_size": int(self.config.chunk_size),
            "action_dim": lay.action_dim,
            "max_action_dim": int(self.config.max_action_dim),
            "action_keys": ["actions"],
            "actions": {"shape": [lay.action_horizon, lay.action_dim], "dtype": "float32"},
            "image_keys": list(lay.images),
            "image_resolution": list(self.size),
            "state_keys": list(lay.state),
            "state_dims": list(lay.state_dims),
            "max_state_dim": int(self.config.max_state_dim),
            "prompt_key": lay.prompt,
            "max_prompt_tokens": self.max_prompt_tokens,
            "normalization": {
                "state": self.state_norm.describe() if self.state_norm else None,
                "actions": self.action_norm.describe() if self.action_norm else None,
            },
            "num_steps": self.num_steps,
            "smoothing": self.smoothing,
        }

    def new_episode(self, seed: int | None = None) -> dict[str, Any]:
        return {"seed": self.seed if seed is None else int(seed), "step": 0, "prev": None}

    # ---- observation -> model inputs ---------------------------------------------------
    def state_vector(self, lay: Layout, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        parts = []
        for key, dim in zip(lay.state, lay.state_dims, strict=True):
            v = arrays[key]  # numeric: payloads carry no other dtypes
            v = v.reshape(-1) if v.ndim <= 1 else v
            if v.shape != (dim,):
                longer = f"; the policy takes at most {self.config.max_state_dim} state dims" if v.size > self.config.max_state_dim else ""
                raise StageError(f"observation {key!r}: expected shape [{dim}], got {list(arrays[key].shape)}{longer}")
            v = v.astype(np.float32)
            if not np.isfinite(v).all():
                raise StageError(f"observation {key!r}: state has NaN or infinite values")
            parts.append(v)
        state = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        if self.state_norm is not None:
            state = self.state_norm.normalize(state)
        out = np.zeros(self.config.max_state_dim, np.float32)
        out[: state.shape[0]] = state
        return out

    def prepare(self, lay: Layout, obs: Payload) -> dict[str, torch.Tensor]:
        """One observation -> the model's inputs (no batch dimension): the processor's
        input_ids, attention_mask, pixel_values and pixel_attention_mask, and the state
        (normalised, padded to max_state_dim)."""
        arrays, texts = obs.arrays, obs.meta.get("text", {})
        missing = [k for k in (*lay.images, *lay.state) if k not in arrays]
        if missing:
            raise StageError(
                f"observation is missing {', '.join(repr(k) for k in missing)} (layout {lay.name!r} needs "
                f"images {list(lay.images)} and state {list(lay.state)})"
            )
        if lay.prompt in arrays:
            raise StageError(f"observation {lay.prompt!r}: the prompt is a string")
        images = [_image(key, arrays[key]) for key in lay.images]
        state = self.state_vector(lay, arrays)
        limit = len(images) * self.image_tokens + self.max_prompt_tokens
        batch = self._processors[lay.name](
            images=[images], text=[texts.get(lay.prompt, lay.default_prompt)], padding="max_length", max_length=limit, return_tensors="pt",
            input_data_format="channels_last",  # `_image` made them HWC: a 1-pixel-high image is not channels-first
        )
        if batch["input_ids"].shape[1] > limit:
            n = batch["input_ids"].shape[1] - len(images) * self.image_tokens
            raise StageError(
                f"observation {lay.prompt!r}: the prompt is {n} tokens (with BOS and newline); this policy takes at most "
                f"{self.max_prompt_tokens} (max_prompt_tokens)"
            )
        out = {k: batch[k][0] for k in ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask")}
        out["state"] = torch.from_numpy(state)
        return out

    # ---- inference -----------------------------------------------------------------------
    async def run(self, ctx: StageContext) -> None:
        try:
            lay = self.layout(ctx.params.get("layout"))
        except KeyError as exc:
            raise StageError(str(exc.args[0])) from None
        episode = dict(ctx.params.get("episode") or self.new_episode())
        async for obs in ctx.input():
            if obs.kind != PayloadKind.OBSERVATION:
                raise StageError(f"the policy takes observations, not {obs.kind.value}")
            t0 = time.perf_counter()
            inputs = await asyncio.to_thread(self.prepare, lay, obs)
            rng = np.random.default_rng([int(episode["seed"]) & 0xFFFFFFFF, int(episode["step"])])
            inputs["noise"] = torch.from_numpy(rng.standard_normal((self.config.chunk_size, self.config.max_action_dim), dtype=np.float32))
            # one host -> device copy here; the prefix KV, state and noisy actions stay there
            enc = await self.steps.run(inputs, op="encode")
            x, dt = enc["x"], -1.0 / self.num_steps
            for k in range(self.num_steps):
                # t as sample_actions computes it (1 + k * dt in double, then float32)
                step = {"kv": enc["kv"], "attention_mask": enc["attention_mask"], "state": enc["state"], "x": x,
                        "t": np.asarray(1.0 + k * dt, np.float32), "dt": np.asarray(dt, np.float32)}
                x = await self.steps.run(step, op="denoise")
            chunk = x.float().cpu().numpy()[: lay.action_horizon, : lay.action_dim]
            actions = self.action_norm.unnormalize(chunk) if self.action_norm is not None else chunk
            actions = np.ascontiguousarray(actions, dtype=np.float32)
            prev = episode.get("prev")
            if prev is not None and self.smoothing > 0:
                # Chunk-boundary smoothing: the first steps lean toward where the previous
                # chunk ended, with a weight that halves (for 0.5) step by step.
                w = (self.smoothing ** np.arange(1, lay.action_horizon + 1, dtype=np.float32))[:, None]
                actions = ((1.0 - w) * actions + w * np.asarray(prev, np.float32)[None, :]).astype(np.float32)
            episode = {"seed": episode["seed"], "step": int(episode["step"]) + 1, "prev": actions[-1].tolist()}
            infer_ms = (time.perf_counter() - t0) * 1000.0
            ctx.add_usage(action_chunks=1)
            await ctx.emit(
                Payload(PayloadKind.ACTIONS, ctx.fence, arrays={"actions": actions}, meta={"episode": episode, "infer_ms": infer_ms}),
                last=True,
            )
