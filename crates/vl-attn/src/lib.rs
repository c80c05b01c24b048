//! vl-attn
