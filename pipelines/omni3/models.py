"""Qwen3-Omni's talker and code2wav as batched step modules (the voice pipeline's `omni3` profile).

One checkpoint directory (``Qwen/Qwen3-Omni-30B-A3B-Instruct``, or the tiny one) serves
three stages: vLLM runs its thinker; the modules here load its ``thinker.*``,
``talker.*`` and ``code2wav.*`` weights into transformers' own classes:

* `Omni3TalkerModule`: the talker reads the thinker's token embeddings (projected by its
  ``text_projection``) everywhere, and the thinker's hidden states at layer
  ``accept_hidden_layer`` (``hidden_projection``) where the user's turns hold audio. The
  reply's rows are embeddings only, so the thinker's layers run once per answer, over
  the prompt, and only when it holds audio, and only up to that layer (the module keeps
  no more of them). Each frame, the MoE talker gives the first codebook's logits and its
  code predictor the other codebooks, every live session in one batched forward.
* `Omni3Code2WavModule`: the causal decoder (codes -> 24 kHz), decoded in windows with
  left context, as the reference's ``chunked_decode``.

Dtypes (`omni_rt.dtypes`): the thinker and the talker are built in their sub-configs'
dtypes, else the checkpoint's (the hub's config names bfloat16 for the thinker and at
the top level, nothing for the talker: both bfloat16, as transformers loads them);
what crosses from the thinker to the talker is cast to the talker's dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_rt.dtypes import config_dtype, dtype_of
from omni_rt.errors import StageError
from pipelines.omni.models import load_part


def omni3_config(model_dir: str) -> Any:
    from transformers import Qwen3OmniMoeConfig

    return Qwen3OmniMoeConfig.from_pretrained(model_dir)


def _sample(logits: torch.Tensor, greedy: torch.Tensor, gens: list[torch.Generator], top_k: int, top_p: float) -> torch.Tensor:
    """One code per row: greedy rows argmax, the others top-k / top-p at temperature 1
    (the code predictor's sampling in the reference), each from its session's generator."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    out = logits.argmax(-1)
    scores = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(top_k)(None, logits.float()))
    probs = torch.softmax(scores, -1)
    for i, g in enumerate(gens):
        if not bool(greedy[i]):
            out[i] = torch.multinomial(probs[i], 1, generator=g)[0]
    return out


class Omni3TalkerModule(torch.nn.Module):
    """The checkpoint's thinker (embeddings, audio encoder and the layers up to
    ``accept_hidden_layer``) and talker (with its code predictor), with per-session state
    in `slots` slots: the talker's KV cache in one tensor
    `[slots, layers, 2, kv_heads, max_len, head_dim]` that decode steps gather from, the
    last hidden state (what the code predictor starts from) and a sampling generator."""

    SLOTS = 16
    MAX_LEN = 4096
    PREDICTOR_TOP_K, PREDICTOR_TOP_P = 50, 0.8

    def __init__(self, model_dir: str | None, slots: int = SLOTS, max_len: int = MAX_LEN, *, config: Any = None, thinker: bool = True) -> None:
        """The checkpoint `model_dir`'s parts; with `model_dir` None, random weights of
        `config`'s shapes (the shapes bench), the thinker left out unless `thinker`
        (frames never use it)."""
        super().__init__()
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeTalkerForConditionalGeneration,
            Qwen3OmniMoeThinkerForConditionalGeneration,
        )

        cfg = omni3_config(model_dir) if model_dir is not None else config
        tc = cfg.talker_config
        self.accept = int(tc.accept_hidden_layer)
        self.thinker: Any = None
        if model_dir is not None or thinker:
            th = Qwen3OmniMoeThinkerForConditionalGeneration._from_config(cfg.thinker_config, dtype=config_dtype(cfg, "thinker_config"))
            n_layers = len(th.model.layers)
            if not 0 < self.accept <= n_layers:
                raise StageError(f"{model_dir}: talker accept_hidden_layer {self.accept} is not one of the thinker's {n_layers} layers")
            th.model.layers = th.model.layers[: self.accept]
            del th.lm_head  # states out: no logits (the vision tower stays: images are states the talker reads)
            kept = tuple(f"model.layers.{i}." for i in range(self.accept))

            def needed(k: str) -> bool:
                if k.startswith("model.layers."):
                    return k.startswith(kept)
                return not k.startswith("lm_head.")

            if model_dir is not None:
                load_part(th, model_dir, "thinker.", keep=needed)
            self.thinker = th
        self.talker = Qwen3OmniMoeTalkerForConditionalGeneration._from_config(tc, dtype=config_dtype(cfg, "talker_config"))
        if model_dir is not None:
            load_part(self.talker, model_dir, "talker.")
        self.audio_token = int(cfg.thinker_config.audio_token_id)
        self.image_token = int(cfg.thinker_config.image_token_id)
        self.mm_tokens = [int(cfg.thinker_config.audio_token_id), int(cfg.thinker_config.image_token_id), int(cfg.thinker_config.video_token_id)]
        self.groups = int(tc.num_code_groups)
        text = tc.text_config
        self.max_len = max_len
        dt = dtype_of(self.talker)
        kv = torch.zeros(slots, text.num_hidden_layers, 2, text.num_key_value_heads, max_len, text.head_dim, dtype=dt)
        self.register_buffer("kv", kv, persistent=False)
        self.register_buffer("lengths", torch.zeros(slots, dtype=torch.long), persistent=False)
        self.register_buffer("deltas", torch.zeros(slots, dtype=torch.long), persistent=False)
        self.register_buffer("last", torch.zeros(slots, text.hidden_size, dtype=dt), persistent=False)
        self.gens = [torch.Generator() for _ in range(slots)]  # on the module's device (`_apply`), seeded by `prefill`

    def _apply(self, fn: Any, recurse: bool = True) -> Omni3TalkerModule:
        """`Module.to(device)` (the torch engine's placement) moves the sessions'
        generators too (sampling draws on the device the logits are on)."""
        super()._apply(fn, recurse)
        if hasattr(self, "gens") and self.gens and self.gens[0].device != self.kv.device:
            self.gens = [torch.Generator(self.kv.device) for _ in self.gens]
        return self

    # ---- the thinker's side ----

    def text_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Thinker tokens as the talker reads text: `text_projection` of their embeddings."""
        embed: Any = self.thinker.get_input_embeddings()
        return self.talker.text_projection(embed(ids.long()).to(dtype_of(self.talker)))

    def user_rows(self, ids: torch.Tensor, features: torch.Tensor | None = None, feature_mask: torch.Tensor | None = None,
                  pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """The prompt's rows as the talker reads them: text rows, and where the prompt is
        audio or an image, `hidden_projection` of the thinker's hidden state at
        `accept_hidden_layer` (the thinker's layers run only then; an image's deepstack
        features join the first layers as the thinker's own forward adds them).
        `pixel_values` [b, patches, dim] / `image_grid_thw` [b, images, 3]: the prompt's
        images as the thinker's processor prepared them."""
        rows = self.text_rows(ids)
        mm = torch.isin(ids, torch.tensor(self.mm_tokens, device=ids.device))
        if (features is None and pixel_values is None) or not bool(mm.any()):
            return rows
        th = self.thinker
        out = []
        caught: list[torch.Tensor] = []

        def catch(_m: Any, _a: Any, o: Any) -> None:
            caught.append(o[0] if isinstance(o, tuple) else o)

        for i in range(ids.shape[0]):
            row, fm = ids[i : i + 1], feature_mask[i : i + 1] if feature_mask is not None else None
            x = th.get_input_embeddings()(row)
            if features is not None:
                audio = th.get_audio_features(features[i : i + 1].to(x.dtype), fm, return_dict=True).last_hidden_state.to(x.dtype)
                x = x.masked_scatter((row == self.audio_token).unsqueeze(-1).expand_as(x), audio)
            grid = image_grid_thw[i] if image_grid_thw is not None else None
            visual: dict[str, Any] = {}
            if pixel_values is not None:
                img = th.get_image_features(pixel_values[i], grid, return_dict=True)
                at = row == self.image_token
                x = x.masked_scatter(at.unsqueeze(-1).expand_as(x), torch.cat(img.pooler_output).to(x.dtype))
                visual = {"visual_pos_masks": at, "deepstack_visual_embeds": [torch.cat(f).to(x.dtype) for f in img.deepstack_features]}
            mask = torch.ones_like(row)
            pos, _ = th.get_rope_index(row, grid, None, mask, False, fm.sum(-1) if fm is not None else None, None)
            pos = torch.cat([torch.arange(row.shape[1], device=pos.device).view(1, 1, -1), pos])  # text positions + M-RoPE's three
            hook = th.model.layers[self.accept - 1].register_forward_hook(catch)
            try:
                res = th.model(inputs_embeds=x, attention_mask=mask, position_ids=pos, use_cache=False, **visual)
            finally:
                hook.remove()
            # hidden_states[n_layers] of the whole thinker is its normed output
            hidden = res.last_hidden_state if self.accept == th.config.text_config.num_hidden_layers else caught[-1]
            r = rows[i].clone()
            m = mm[i]
            r[m] = self.talker.hidden_projection(hidden[0][m].to(r.dtype))
            out.append(r)
        return torch.stack(out)

    def codec_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Codec-vocabulary embeddings (the prompt's special codec rows)."""
        embed: Any = self.talker.get_input_embeddings()
        return embed(ids.long())

    # ---- the talker ----

    def prefill(self, slot: torch.Tensor, embeds: torch.Tensor, talker_ids: torch.Tensor, seed: torch.Tensor,
                audio_lengths: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """The talker's prompt (`embeds` over `talker_ids`, whose multimodal tokens place
        M-RoPE positions when `audio_lengths` or `image_grid_thw` is given): fills the
        slot's cache; returns the first frame's first-codebook logits."""
        from transformers import DynamicCache

        t = self.talker
        logits = []
        for i in range(embeds.shape[0]):
            s, row = int(slot[i]), talker_ids[i : i + 1]
            n = row.shape[1]
            if n >= self.max_len:
                raise StageError(f"the talker's prompt is {n} positions; its cache holds {self.max_len}")
            mask = torch.ones_like(row)
            if audio_lengths is not None or image_grid_thw is not None:
                al = audio_lengths[i : i + 1] if audio_lengths is not None else None
                pos, delta = t.get_rope_index(row, image_grid_thw[i] if image_grid_thw is not None else None, None, mask, False, al, None)
            else:
                pos, delta = torch.arange(n, device=row.device).view(1, 1, n).expand(3, 1, n), torch.zeros(1, 1, dtype=torch.long)
            cache = DynamicCache(config=t.config.text_config)
            out = t.model(inputs_embeds=embeds[i : i + 1].to(dtype_of(t)), attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
            for li, layer in enumerate(cache.layers):
                self.kv[s, li, 0, :, :n] = layer.keys[0]
                self.kv[s, li, 1, :, :n] = layer.values[0]
            self.lengths[s] = n
            self.deltas[s] = int(delta.reshape(-1)[0])
            self.last[s] = out.last_hidden_state[0, -1]
            self.gens[s].manual_seed(int(seed[i]))
            logits.append(t.codec_head(out.last_hidden_state[0, -1]).float())
        return torch.stack(logits)

    def frame(self, slot: torch.Tensor, code: torch.Tensor, text: torch.Tensor, greedy: torch.Tensor) -> dict[str, torch.Tensor]:
        """One frame of every given slot: the code predictor completes the frame whose
        first code is `code` (from the slot's last hidden state), then the talker takes
        the frame (the sum of its codebooks' embeddings) plus the `text` row. Returns
        the frame's codes [B, groups] and the next frame's first-codebook logits."""
        from transformers import DynamicCache

        t, cp = self.talker, self.talker.code_predictor
        slots = slot.long()
        b = slots.shape[0]
        gens = [self.gens[int(s)] for s in slots]
        first = t.get_input_embeddings()(code.long().view(b, 1))  # [B, 1, D]
        x = torch.cat([self.last[slots].unsqueeze(1), first], 1)
        cache = DynamicCache(config=cp.config)
        codes, embeds = [code.long().view(b)], [first]
        for g in range(1, self.groups):
            h = cp.model(inputs_embeds=x, past_key_values=cache, use_cache=True).last_hidden_state[:, -1]
            c = _sample(cp.lm_head[g - 1](h), greedy, gens, self.PREDICTOR_TOP_K, self.PREDICTOR_TOP_P)
            codes.append(c)
            x = cp.get_input_embeddings()[g - 1](c.view(b, 1))
            embeds.append(x)
        lens = self.lengths[slots]
        if int(lens.max()) + 1 > self.max_len:
            raise StageError(f"the talker's cache is full ({self.max_len} positions)")
        span = int(lens.max())
        kv = self.kv[slots, :, :, :, :span]
        tcache = DynamicCache(ddp_cache_data=[(kv[:, li, 0], kv[:, li, 1]) for li in range(kv.shape[1])], config=t.config.text_config)
        mask = torch.cat([(torch.arange(span, device=lens.device)[None, :] < lens[:, None]).long(),
                          torch.ones(b, 1, dtype=torch.long, device=lens.device)], 1)
        inp = torch.cat(embeds, 1).sum(1, keepdim=True) + text.view(b, 1, -1).to(self.last.dtype)
        pos = (lens + self.deltas[slots]).view(1, b, 1).expand(3, b, 1)
        out = t.model(inputs_embeds=inp, attention_mask=mask, position_ids=pos, past_key_values=tcache, use_cache=True)
        for li, layer in enumerate(tcache.layers):
            self.kv[slots, li, 0, :, lens] = layer.keys[:, :, -1]
            self.kv[slots, li, 1, :, lens] = layer.values[:, :, -1]
        self.lengths[slots] = lens + 1
        h = out.last_hidden_state[:, -1]
        self.last[slots] = h
        return {"codes": torch.stack(codes, 1), "logits": t.codec_head(h).float()}

    def release(self, slot: torch.Tensor) -> torch.Tensor:
        for s in slot.tolist():
            self.lengths[int(s)] = 0
        return torch.zeros(slot.shape[0])


class Omni3Code2WavModule(torch.nn.Module):
    """The checkpoint's code2wav (float32): codes [B, frames, groups] -> [B, samples]."""

    def __init__(self, model_dir: str | None, *, config: Any = None) -> None:
        """The checkpoint `model_dir`'s code2wav; with `model_dir` None, random weights of
        `config`'s shapes (the shapes bench)."""
        super().__init__()
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

        cfg = omni3_config(model_dir) if model_dir is not None else config
        self.model = Qwen3OmniMoeCode2Wav._from_config(cfg.code2wav_config)
        if model_dir is not None:
            load_part(self.model, model_dir, "code2wav.")
        self.model.float()

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        wav: torch.Tensor = self.model(codes.long().transpose(1, 2))
        return wav.reshape(codes.shape[0], -1)
