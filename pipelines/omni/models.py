"""Qwen2.5-Omni's talker and token2wav as batched step modules (the omni profile).

One checkpoint directory (``Qwen/Qwen2.5-Omni-*``, or the tiny one) serves three stages:
vLLM runs its thinker; the modules here load the checkpoint's ``thinker.*``,
``talker.*`` and ``token2wav.*`` weights into transformers' own classes
(``Qwen2_5OmniThinkerForConditionalGeneration``, ``Qwen2_5OmniTalkerForConditionalGeneration``,
``Qwen2_5OmniToken2WavModel``) and expose the steps a serving loop needs:

* `OmniTalkerModule`: the talker conditions on the thinker's token embeddings and last
  hidden states. vLLM streams tokens, not states, so the module recomputes them with the
  checkpoint's thinker, incrementally (a KV cache per session: the prompt once, then each
  reply token as it arrives). The talker decodes from a slot-based KV cache: every live
  session's next codec token comes out of one batched forward.
* `Token2WavModule`: the flow-matching DiT over a window of codes with noise the caller
  supplies (so a chunked decode draws the same noise as a whole one), and BigVGAN.

Dtypes (`omni_rt.dtypes`): the thinker and the talker are built in their sub-configs'
dtypes (the hub's: bfloat16), token2wav in float32 as the reference runs it; every
method casts what it is handed to the dtype of the sub-model that reads it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from omni_rt.dtypes import config_dtype, dtype_of
from omni_rt.errors import StageError


def load_part(module: torch.nn.Module, model_dir: str, prefix: str, keep: Callable[[str], bool] | None = None) -> None:
    """Load the checkpoint's `prefix`* weights into `module` (only those tensors are
    read: a sharded checkpoint's index names the files that hold them); `keep`: which of
    them (by name past the prefix) the module holds, when it holds part of that model."""
    from safetensors import safe_open

    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({f for k, f in json.loads(index.read_text())["weight_map"].items() if k.startswith(prefix)})
    else:
        files = [p.name for p in sorted(d.glob("*.safetensors"))]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(d / name), "pt") as st:
            for k in st.keys():
                if k.startswith(prefix) and (keep is None or keep(k[len(prefix):])):
                    state[k[len(prefix):]] = st.get_tensor(k)
    if not state:
        raise StageError(f"{model_dir}: no {prefix}* weights (an Omni checkpoint with its talker and vocoder)")
    missing, unexpected = module.load_state_dict(stack_experts(state), strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]  # buffers computed at init
    if missing or unexpected:
        raise StageError(f"{model_dir}: {prefix}* weights do not fit the config: missing {missing[:4]}, unexpected {unexpected[:4]}")


_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MoE weights in the layout transformers' modules hold: the hub checkpoints store
    each expert's `gate_proj` / `up_proj` / `down_proj`; the modules one
    `gate_up_proj` [experts, 2 x inner, hidden] (gate rows, then up) and one `down_proj`
    [experts, hidden, inner] per layer (what from_pretrained converts on load)."""
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        m = _EXPERT.fullmatch(k)
        if m is None:
            out[k] = v
        else:
            experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = v
    for base, parts in experts.items():
        n = len(parts.get("down", {}))
        if any(sorted(p) != list(range(n)) for p in parts.values()) or set(parts) != {"gate", "up", "down"}:
            raise StageError(f"{base}: the checkpoint's experts are incomplete")
        out[f"{base}.gate_up_proj"] = torch.stack([torch.cat([parts["gate"][i], parts["up"][i]]) for i in range(n)])
        out[f"{base}.down_proj"] = torch.stack([parts["down"][i] for i in range(n)])
    return out


def omni_config(model_dir: str) -> Any:
    from transformers import Qwen2_5OmniConfig

    return Qwen2_5OmniConfig.from_pretrained(model_dir)


def load_speakers(model_dir: str) -> dict[str, dict[str, Any]]:
    """`spk_dict.pt`: per speaker the DiT's x-vector (`cond`), a reference mel
    (`ref_mel`) and the id that starts the talker's text stream (`bos_token`). The hub
    repos store `cond` as (1, 192) and `ref_mel` as (1, frames, 80), with a batch row, as
    transformers does; both are read with or without it: `cond` as (192,), `ref_mel`
    as (frames, 80), float32."""
    path = Path(model_dir) / "spk_dict.pt"
    if not path.is_file():
        raise StageError(f"{model_dir}: no spk_dict.pt (the checkpoint's speakers)")
    out: dict[str, dict[str, Any]] = {}
    for name, sp in dict(torch.load(str(path), weights_only=True)).items():
        try:
            cond = torch.as_tensor(sp["cond"]).float().reshape(-1)
            mel = torch.as_tensor(sp["ref_mel"]).float()
            mel = mel.reshape(-1, mel.shape[-1])
            bos = int(sp["bos_token"])
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as exc:
            raise StageError(f"{model_dir}: spk_dict.pt speaker {name!r} is not cond / ref_mel / bos_token ({exc})") from None
        out[str(name)] = {"cond": cond, "ref_mel": mel, "bos_token": bos}
    if not out:
        raise StageError(f"{model_dir}: spk_dict.pt names no speakers")
    return out


class OmniTalkerModule(torch.nn.Module):
    """The checkpoint's thinker (states only) and talker, with per-session state in
    `slots` slots: the thinker's KV cache per slot, and the talker's KV cache in one
    tensor `[slots, layers, 2, kv_heads, max_len, head_dim]` that decode steps gather from."""

    SLOTS = 16
    MAX_LEN = 4096

    def __init__(self, model_dir: str | None, slots: int = SLOTS, max_len: int = MAX_LEN, *, config: Any = None, thinker: bool = True) -> None:
        """The checkpoint `model_dir`'s parts; with `model_dir` None, random weights of
        `config`'s shapes (the shapes bench), the thinker left out unless `thinker`
        (decode steps never use it)."""
        super().__init__()
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
            Qwen2_5OmniTalkerForConditionalGeneration,
            Qwen2_5OmniThinkerForConditionalGeneration,
        )

        cfg = omni_config(model_dir) if model_dir is not None else config
        self.thinker: Any = None
        if model_dir is not None or thinker:
            self.thinker = Qwen2_5OmniThinkerForConditionalGeneration._from_config(cfg.thinker_config, dtype=config_dtype(cfg, "thinker_config"))
            # states out: no logits (the LM head, stored or tied to the embeddings, would
            # only spend a vocabulary-wide matmul a token); the vision tower stays (images
            # in the prompt are states the talker reads)
            self.thinker.lm_head = torch.nn.Identity()
        self.talker = Qwen2_5OmniTalkerForConditionalGeneration._from_config(cfg.talker_config, dtype=config_dtype(cfg, "talker_config"))
        if model_dir is not None:
            load_part(self.thinker, model_dir, "thinker.", keep=lambda k: not k.startswith("lm_head."))
            load_part(self.talker, model_dir, "talker.")
        self.audio_token = int(cfg.thinker_config.audio_token_index)
        self.image_token = int(cfg.thinker_config.image_token_index)
        tc = cfg.talker_config
        self.max_len = max_len
        kv = torch.zeros(slots, tc.num_hidden_layers, 2, tc.num_key_value_heads, max_len, tc.head_dim, dtype=dtype_of(self.talker))
        self.register_buffer("kv", kv, persistent=False)
        self.register_buffer("lengths", torch.zeros(slots, dtype=torch.long), persistent=False)
        self.register_buffer("deltas", torch.zeros(slots, dtype=torch.long), persistent=False)
        self._thinker: dict[int, tuple[Any, int, int]] = {}  # slot -> (cache, length, rope delta)

    # ---- the thinker's states ----

    def think_prompt(self, slot: torch.Tensor, ids: torch.Tensor, features: torch.Tensor | None = None,
                     feature_mask: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                     image_grid_thw: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The prompt's token embeddings (the audio's and images' rows zeroed, as the
        reference hands them to the talker) and last hidden states; starts the slot's
        thinker cache. `pixel_values` [b, patches, dim] / `image_grid_thw` [b, images, 3]:
        the prompt's images as the thinker's processor prepared them."""
        from transformers import DynamicCache

        embeds, hidden = [], []
        dt = dtype_of(self.thinker)
        for i in range(ids.shape[0]):
            row = ids[i : i + 1]
            mask = torch.ones_like(row)
            fm = feature_mask[i : i + 1] if feature_mask is not None else None
            grid = image_grid_thw[i] if image_grid_thw is not None else None
            pos, delta = self.thinker.get_rope_index(row, grid, None, mask, False, fm.sum(-1) if fm is not None else None, None)
            cache = DynamicCache(config=self.thinker.config.text_config)
            out = self.thinker(input_ids=row, input_features=features[i : i + 1].to(dt) if features is not None else None,
                               feature_attention_mask=fm, attention_mask=mask, position_ids=pos, past_key_values=cache,
                               pixel_values=pixel_values[i].to(dt) if pixel_values is not None else None, image_grid_thw=grid,
                               use_cache=True, output_hidden_states=True)
            emb = out.hidden_states[0].clone()
            emb[(row == self.audio_token) | (row == self.image_token)] = 0
            embeds.append(emb[0])
            hidden.append(out.hidden_states[-1][0])
            self._thinker[int(slot[i])] = (cache, row.shape[1], int(delta.reshape(-1)[0]))
        return {"embeds": torch.stack(embeds), "hidden": torch.stack(hidden)}

    def think_reply(self, slot: torch.Tensor, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Reply tokens fed to the thinker as it consumed them: their embeddings and
        last hidden states (continuing each slot's cache)."""
        embeds, hidden = [], []
        for i in range(ids.shape[0]):
            s = int(slot[i])
            cache, length, delta = self._thinker[s]
            row = ids[i : i + 1]
            n = row.shape[1]
            pos = (torch.arange(length, length + n, device=row.device) + delta).view(1, 1, n).expand(3, 1, n)
            out = self.thinker(input_ids=row, position_ids=pos, past_key_values=cache, use_cache=True, output_hidden_states=True)
            embeds.append(out.hidden_states[0][0])
            hidden.append(out.hidden_states[-1][0])
            self._thinker[s] = (cache, length + n, delta)
        return {"embeds": torch.stack(embeds), "hidden": torch.stack(hidden)}

    def text_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Thinker-vocabulary embeddings (the talker's text-start, end and pad rows)."""
        embed: Callable[[torch.Tensor], torch.Tensor] = self.thinker.get_input_embeddings()
        return embed(ids)

    # ---- the talker ----

    def talk_prefill(self, slot: torch.Tensor, embeds: torch.Tensor, text_ids: torch.Tensor,
                     audio_lengths: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """The talker's prompt: `embeds` (thinker states + embeddings of the prompt,
        the speaker's text-start row, the reply's first row) over `text_ids`
        (positions: the thinker prompt's M-RoPE index). Fills the slot's cache; returns
        the first codec token's logits."""
        from transformers import DynamicCache

        t = self.talker
        logits = []
        for i in range(embeds.shape[0]):
            s, row = int(slot[i]), text_ids[i : i + 1]
            n = row.shape[1]
            if n >= self.max_len:
                raise StageError(f"the talker's prompt is {n} positions; its cache holds {self.max_len}")
            mask = torch.ones_like(row)
            al = audio_lengths[i : i + 1] if audio_lengths is not None else None
            grid = image_grid_thw[i] if image_grid_thw is not None else None
            pos, delta = t.get_rope_index(row, grid, None, mask, False, al, None)
            x = embeds[i : i + 1].to(dtype_of(t), copy=True)
            codec = t.get_input_embeddings()
            x[:, -1] += codec(torch.tensor([t.codec_bos_token], device=x.device))
            x[:, -2] += codec(torch.tensor([t.codec_pad_token], device=x.device))
            cache = DynamicCache(config=t.config)
            out = t.model(inputs_embeds=t.thinker_to_talker_proj(x), attention_mask=mask, position_ids=pos,
                          past_key_values=cache, use_cache=True)
            for li, layer in enumerate(cache.layers):
                self.kv[s, li, 0, :, :n] = layer.keys[0]
                self.kv[s, li, 1, :, :n] = layer.values[0]
            self.lengths[s] = n
            self.deltas[s] = int(delta.reshape(-1)[0])
            logits.append(t.codec_head(out.last_hidden_state[0, -1]).float())
        return torch.stack(logits)

    def talk_step(self, slot: torch.Tensor, code: torch.Tensor, reply: torch.Tensor) -> torch.Tensor:
        """One decode step of every given slot in one forward: input the last codec
        token plus the reply row; returns each slot's next-token logits."""
        from transformers import DynamicCache

        t = self.talker
        slots = slot.long()
        lens = self.lengths[slots]
        if int(lens.max()) + 1 > self.max_len:
            raise StageError(f"the talker's cache is full ({self.max_len} positions)")
        span = int(lens.max())
        kv = self.kv[slots, :, :, :, :span]  # [B, L, 2, H, T, D]
        cache = DynamicCache(ddp_cache_data=[(kv[:, li, 0], kv[:, li, 1]) for li in range(kv.shape[1])], config=t.config)
        b = slots.shape[0]
        mask = torch.cat([(torch.arange(span, device=lens.device)[None, :] < lens[:, None]).long(),
                          torch.ones(b, 1, dtype=torch.long, device=lens.device)], 1)
        x = t.get_input_embeddings()(code.long().view(b, 1)) + reply.view(b, 1, -1).to(dtype_of(t))
        pos = (lens + self.deltas[slots]).view(1, b, 1).expand(3, b, 1)
        out = t.model(inputs_embeds=t.thinker_to_talker_proj(x), attention_mask=mask, position_ids=pos,
                      past_key_values=cache, use_cache=True)
        for li, layer in enumerate(cache.layers):
            self.kv[slots, li, 0, :, lens] = layer.keys[:, :, -1]
            self.kv[slots, li, 1, :, lens] = layer.values[:, :, -1]
        self.lengths[slots] = lens + 1
        return t.codec_head(out.last_hidden_state[:, -1]).float()

    def release(self, slot: torch.Tensor) -> torch.Tensor:
        for s in slot.tolist():
            self._thinker.pop(int(s), None)
            self.lengths[int(s)] = 0
        return torch.zeros(slot.shape[0])


class Token2WavModule(torch.nn.Module):
    """The checkpoint's token2wav (float32, as the reference runs it; an overlay's dtype
    casts it)."""

    def __init__(self, model_dir: str | None, *, config: Any = None) -> None:
        """The checkpoint `model_dir`'s token2wav; with `model_dir` None, random weights of
        `config`'s shapes (the shapes bench)."""
        super().__init__()
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

        cfg = omni_config(model_dir) if model_dir is not None else config
        self.model = Qwen2_5OmniToken2WavModel._from_config(cfg.token2wav_config)
        if model_dir is not None:
            load_part(self.model, model_dir, "token2wav.")
        self.model.float()
        self.repeats = int(cfg.token2wav_config.dit_config.repeats)  # mel frames a code

    def mel(self, codes: torch.Tensor, noise: torch.Tensor, cond: torch.Tensor, ref_mel: torch.Tensor,
            steps: torch.Tensor, guidance: torch.Tensor, sway: torch.Tensor) -> torch.Tensor:
        """The DiT's flow-matching ODE (RK4, classifier-free guidance, sway sampling:
        the reference's `sample`) from the given `noise` [B, frames, mel]; mel [B, mel, frames]."""
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        dit = self.model.code2wav_dit_model
        dt = dtype_of(dit)
        frames = codes.shape[1] * self.repeats
        cvec = cond.to(dt).reshape(cond.shape[0], 1, -1).repeat(1, frames, 1)
        mel_ref = ref_mel.to(dt).reshape(ref_mel.shape[0], -1, ref_mel.shape[-1])
        g = float(guidance.reshape(-1)[0])

        def ode(time_step: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            out = dit(hidden_states=h, quantized_code=codes.long(), speaker_embedding=cvec, condition_vector=mel_ref,
                      time_step=time_step, apply_cfg=g >= 1e-5, drop_audio_conditioning=False, drop_code=False)
            if g < 1e-5:
                return out
            guided, null = torch.chunk(out, 2, dim=0)
            return guided + (guided - null) * g

        n = int(steps.reshape(-1)[0])
        t = torch.linspace(0, 1, n, dtype=cvec.dtype, device=cvec.device)
        s = float(sway.reshape(-1)[0])
        t = t + s * (torch.cos(torch.pi / 2 * t) - 1 + t)
        return RungeKutta4ODESolver(function=ode, initial_value=noise.to(dt)).integrate(t)[-1].permute(0, 2, 1)

    def vocode(self, mel: torch.Tensor) -> torch.Tensor:
        """BigVGAN: mel [B, mel, frames] -> 24 kHz waveform [B, frames x the upsampling rates' product]."""
        vocoder = self.model.code2wav_bigvgan_model
        return vocoder(mel.to(dtype_of(vocoder))).reshape(mel.shape[0], -1)
