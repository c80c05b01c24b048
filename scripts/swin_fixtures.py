#!/usr/bin/env python3
"""Writes the Swin parity fixtures under tests/fixtures/swin/.

Tiny transformers `DonutSwinModel`s (Donut's and Nougat's encoder: no final
LayerNorm, no absolute position embeddings), random weights from fixed
seeds, each with random normalised pixels and transformers' output on them
(`last_hidden_state`; the pooler is not vl's):

- `a/`: 64x48 (height x width) input, patch 4 (16x12, then 8x6 tokens),
  embed 16, depths 2/2, heads 2/4, window 3 (16 is not a multiple: the
  first stage pads its windows), qkv biases, MLP ratio 4; also a 70x50
  input (pixels padded to whole patches: 18x13, then 9x7, odd sides
  padded by the patch merging).
- `b/`: 60x44 input, patch 4 (15x11, 8x6), embed 8, depths 2/4, heads
  1/2, window 4 (every stage pads), no qkv biases, MLP ratio 2, gelu_new.
- `c/`: 32x32 input, patch 2 (16x16, 8x8, 4x4), embed 12, depths 2/2/2,
  heads 2/2/4, window 4: the last stage's map is the window (one window,
  no shift).

Every parameter is drawn from N(0, 0.5²) (LayerNorm weights around 1), so
that the relative position bias tables, biases and norms all matter.
Attention is eager, everything f32. `expected.safetensors` holds
`pixel_values` (and `pixel_values_other` for `a`) with their outputs
`last_hidden_state` (`last_hidden_state_other`).

    .venv/bin/python scripts/swin_fixtures.py        # rewrites tests/fixtures/swin
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import DonutSwinConfig, DonutSwinModel

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "swin"

CONFIGS = {
    "a": dict(image_size=[64, 48], patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
              window_size=3, qkv_bias=True, mlp_ratio=4.0, hidden_act="gelu", other=(70, 50)),
    "b": dict(image_size=[60, 44], patch_size=4, embed_dim=8, depths=[2, 4], num_heads=[1, 2],
              window_size=4, qkv_bias=False, mlp_ratio=2.0, hidden_act="gelu_new", other=None),
    "c": dict(image_size=[32, 32], patch_size=2, embed_dim=12, depths=[2, 2, 2], num_heads=[2, 2, 4],
              window_size=4, qkv_bias=True, mlp_ratio=2.0, hidden_act="gelu", other=None),
}


def main():
    for i, (name, spec) in enumerate(CONFIGS.items()):
        spec = dict(spec)
        other = spec.pop("other")
        torch.manual_seed(100 + i)
        cfg = DonutSwinConfig(num_channels=3, use_absolute_embeddings=False, drop_path_rate=0.0,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **spec)
        cfg._attn_implementation = "eager"
        model = DonutSwinModel(cfg, add_pooling_layer=False).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "layernorm" in pname or pname.endswith("norm.weight"):
                    p.copy_(1.0 + 0.5 * torch.randn_like(p)) if pname.endswith("weight") else p.normal_(0, 0.5)
                else:
                    p.normal_(0, 0.5 if p.dim() < 2 else (1.0 / p.shape[-1]) ** 0.5)
        d = OUT / name
        d.mkdir(parents=True, exist_ok=True)
        cfg.save_pretrained(d)
        state = {k: v.contiguous() for k, v in model.state_dict().items()
                 if "relative_position_index" not in k}
        save_file(state, d / "model.safetensors")
        h, w = spec["image_size"]
        expected = {}
        with torch.no_grad():
            px = torch.randn(2, 3, h, w)
            expected["pixel_values"] = px
            expected["last_hidden_state"] = model(pixel_values=px).last_hidden_state
            if other:
                px = torch.randn(1, 3, *other)
                expected["pixel_values_other"] = px
                expected["last_hidden_state_other"] = model(pixel_values=px).last_hidden_state
        save_file({k: v.contiguous() for k, v in expected.items()}, d / "expected.safetensors")
        meta = {k: list(v.shape) for k, v in expected.items()}
        import transformers
        meta.update(transformers=transformers.__version__, torch=torch.__version__)
        (d / "expected.json").write_text(json.dumps(meta, indent=1) + "\n")
        print(name, meta)


if __name__ == "__main__":
    main()
