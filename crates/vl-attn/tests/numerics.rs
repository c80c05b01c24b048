//! Numerics under every mask pattern, dtype and backend, with inputs whose
//! attention logits reach 1e30 in f32 and bf16, and f16's largest value and
//! beyond in f16: outputs never hold NaN or Inf, and a query with no key
//! left gets an exactly zero output row.
#![allow(missing_docs)]

mod common;

use candle_core::{DType, Device, IndexOp, Tensor, D};
use candle_nn::VarMap;
use common::*;
use proptest::prelude::*;
use vl_attn::attention::{attention, Weights, AUTO_FUSED_MAX_Q_LEN};
use vl_attn::mask::{self, PaddingSide};
use vl_attn::{
    Backend, CausalSelfAttention, CrossAttention, CrossAttentionConfig, KvCache, Mask,
    SelfAttentionConfig,
};

const BACKENDS: [Backend; 3] = [Backend::Reference, Backend::Fused, Backend::Auto];
const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// The largest finite f16.
const F16_MAX: f32 = 65504.0;

/// Every mask pattern the kernels and modules meet.
#[derive(Debug, Clone, Copy)]
enum MaskKind {
    /// No mask at all.
    Absent,
    /// Random keys per sample and query (`per_query`) or per sample.
    Random { density: f32, per_query: bool },
    /// Random keys, then some query rows cleared entirely.
    EmptyRows { density: f32 },
    /// Every key of every query masked.
    AllMasked,
    /// A mask that masks nothing.
    NoneMasked,
    /// Bottom-right aligned causal (top-left when there are fewer keys
    /// than queries).
    Causal,
    /// Key padding, per sample, lengths from 0 to every key.
    KeyPadding { side: PaddingSide },
}

fn mask_kinds() -> impl Strategy<Value = MaskKind> {
    prop_oneof![
        Just(MaskKind::Absent),
        (0.0f32..1.0, any::<bool>())
            .prop_map(|(density, per_query)| MaskKind::Random { density, per_query }),
        (0.0f32..1.0).prop_map(|density| MaskKind::EmptyRows { density }),
        Just(MaskKind::AllMasked),
        Just(MaskKind::NoneMasked),
        Just(MaskKind::Causal),
        prop_oneof![Just(PaddingSide::Left), Just(PaddingSide::Right)]
            .prop_map(|side| MaskKind::KeyPadding { side }),
    ]
}

impl MaskKind {
    /// The mask for `batch` samples of `q_len` queries over `k_len` keys.
    fn build(self, batch: usize, q_len: usize, k_len: usize, seed: u64) -> Option<Mask> {
        let dev = Device::Cpu;
        let u8_mask = |shape: &[usize], density: f32, seed: u64| {
            seeded_mask(shape, seed, density)
                .to_dtype(DType::U8)
                .expect("u8")
        };
        let t = match self {
            MaskKind::Absent => return None,
            MaskKind::Random { density, per_query } => {
                let mq = if per_query { q_len } else { 1 };
                u8_mask(&[batch, mq, k_len], density, seed)
            }
            MaskKind::EmptyRows { density } => {
                let keys = u8_mask(&[batch, q_len, k_len], density, seed);
                let rows = u8_mask(&[batch, q_len, 1], 0.5, seed ^ 0x5A5A);
                keys.broadcast_mul(&rows).expect("clear rows")
            }
            MaskKind::AllMasked => Tensor::zeros((1, 1, k_len), DType::U8, &dev).expect("zeros"),
            MaskKind::NoneMasked => {
                Tensor::ones((batch, q_len, k_len), DType::U8, &dev).expect("ones")
            }
            MaskKind::Causal if k_len >= q_len => {
                mask::causal_with_offset(q_len, k_len - q_len, &dev).expect("causal")
            }
            MaskKind::Causal => mask::causal(q_len, &dev)
                .and_then(|m| Ok(m.narrow(1, 0, k_len)?))
                .expect("causal"),
            MaskKind::KeyPadding { side } => {
                let lengths: Vec<usize> = (0..batch)
                    .map(|b| (seed.wrapping_add(b as u64 * 7919) % (k_len as u64 + 1)) as usize)
                    .collect();
                let keys = mask::key_padding(&lengths, k_len, side, &dev).expect("padding");
                return Some(Mask::from_keys(&keys).expect("mask"));
            }
        };
        Some(Mask::new(t).expect("mask"))
    }
}

/// `(batch, q_len)`: whether each query may attend to at least one key.
fn attending(mask: Option<&Mask>, batch: usize, q_len: usize, k_len: usize) -> Vec<Vec<bool>> {
    match mask {
        None => vec![vec![k_len > 0; q_len]; batch],
        Some(m) => m
            .tensor()
            .broadcast_as((batch, q_len, k_len))
            .and_then(|t| t.max(2))
            .and_then(|t| t.to_vec2::<u8>())
            .expect("any key")
            .into_iter()
            .map(|row| row.into_iter().map(|x| x != 0).collect())
            .collect(),
    }
}

/// `seeded` data whose rows (last dimension) all have the L2 norm `norm`.
fn rows_of_norm(shape: &[usize], seed: u64, norm: f64) -> Tensor {
    let t = seeded(shape, seed);
    let n = t
        .sqr()
        .and_then(|s| s.sum_keepdim(D::Minus1))
        .and_then(|s| s.sqrt())
        .and_then(|s| s.clamp(1e-6f32, f32::MAX))
        .expect("norm");
    (t.broadcast_div(&n).expect("unit") * norm).expect("scale")
}

/// The largest |logit| a case aims at, per dtype: in f32 and bf16 up to
/// 1e30; in f16 just under its largest finite value, and past it (1e8: the
/// inputs are representable in f16, the logits are not).
fn logit_bounds(dtype: DType) -> &'static [f64] {
    match dtype {
        DType::F16 => &[1.0, 1e2, 1e4, 0.9 * F16_MAX as f64, 1e8],
        _ => &[1.0, 1e4, 1e10, 1e20, 1e30],
    }
}

fn check_output(
    out: &Tensor,
    live: &[Vec<bool>],
    what: &str,
) -> std::result::Result<(), TestCaseError> {
    prop_assert!(all_finite(out), "{what}: NaN or Inf in the output");
    // (batch, q_len, ..) or (batch, heads, q_len, ..): rows of dead queries are 0.
    let out = out.to_dtype(DType::F32).expect("f32");
    for (b, row) in live.iter().enumerate() {
        for (i, &alive) in row.iter().enumerate() {
            if alive {
                continue;
            }
            let dead = match out.rank() {
                3 => out.i((b, i)),
                _ => out.i((b, .., i)),
            }
            .and_then(|t| t.abs()?.sum_all()?.to_scalar::<f32>())
            .expect("row");
            prop_assert!(
                dead == 0.0,
                "{what}: sample {b} query {i} attends to nothing but got |out| = {dead}"
            );
        }
    }
    Ok(())
}

#[derive(Debug, Clone)]
struct KernelCase {
    batch_k: usize,
    r: usize,
    kv_heads: usize,
    groups: usize,
    q_len: usize,
    k_len: usize,
    head_dim: usize,
    mask: MaskKind,
    seed: u64,
}

fn kernel_cases() -> impl Strategy<Value = KernelCase> {
    (
        (1usize..3, 1usize..3, 1usize..3, 1usize..3),
        // Past AUTO_FUSED_MAX_Q_LEN, Auto takes the reference path off CPU
        // and the tiled kernel on CPU.
        prop_oneof![
            1usize..6,
            AUTO_FUSED_MAX_Q_LEN + 1..AUTO_FUSED_MAX_Q_LEN + 4
        ],
        1usize..12,
        prop_oneof![Just(1usize), Just(4), Just(8), Just(24)],
        mask_kinds(),
        any::<u64>(),
    )
        .prop_map(
            |((batch_k, r, kv_heads, groups), q_len, k_len, head_dim, mask, seed)| KernelCase {
                batch_k,
                r,
                kv_heads,
                groups,
                q_len,
                k_len,
                head_dim,
                mask,
                seed,
            },
        )
}

#[derive(Debug, Clone)]
struct ModuleCase {
    batch_k: usize,
    r: usize,
    kv_heads: usize,
    groups: usize,
    head_dim: usize,
    q_len: usize,
    mem_len: usize,
    mask: MaskKind,
    seed: u64,
}

fn module_cases() -> impl Strategy<Value = ModuleCase> {
    (
        (1usize..3, 1usize..3, 1usize..3, 1usize..3),
        prop_oneof![Just(1usize), Just(4), Just(8)],
        prop_oneof![
            1usize..6,
            AUTO_FUSED_MAX_Q_LEN + 1..AUTO_FUSED_MAX_Q_LEN + 3
        ],
        1usize..10,
        mask_kinds(),
        any::<u64>(),
    )
        .prop_map(
            |((batch_k, r, kv_heads, groups), head_dim, q_len, mem_len, mask, seed)| ModuleCase {
                batch_k,
                r,
                kv_heads,
                groups,
                head_dim,
                q_len,
                mem_len,
                mask,
                seed,
            },
        )
}

/// Rescales every weight of `vars` so that each projection maps inputs of
/// norm 1 to outputs of norm at most about 1 (rows of norm `1 / sqrt(out)`),
/// and zeroes the biases, so that the input's scale sets the logits.
fn normalise_weights(vars: &VarMap) {
    let data = vars.data().lock().expect("vars");
    for (name, var) in data.iter() {
        let t = var.as_tensor();
        let fresh = if name.ends_with("bias") {
            t.zeros_like().expect("zeros")
        } else {
            let (out, _) = t.dims2().expect("weight");
            rows_of_norm(t.dims(), name.len() as u64, 1.0 / (out as f64).sqrt())
                .to_dtype(t.dtype())
                .expect("dtype")
        };
        var.set(&fresh).expect("set");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn kernel_outputs_are_finite_and_dead_rows_zero(c in kernel_cases()) {
        let bq = c.batch_k * c.r;
        let heads = c.kv_heads * c.groups;
        let scale = 1.0 / (c.head_dim as f64).sqrt();
        let mask = c.mask.build(bq, c.q_len, c.k_len, c.seed);
        let live = attending(mask.as_ref(), bq, c.q_len, c.k_len);
        for dtype in DTYPES {
            for &bound in logit_bounds(dtype) {
                // |q|·|k|·scale = bound bounds every logit (Cauchy-Schwarz).
                let norm = (bound / scale).sqrt();
                let cast = |t: Tensor| t.to_dtype(dtype).expect("dtype");
                let q = cast(rows_of_norm(&[bq, heads, c.q_len, c.head_dim], c.seed, norm));
                let kv_shape = [c.batch_k, c.kv_heads, c.k_len, c.head_dim];
                let k = cast(rows_of_norm(&kv_shape, c.seed + 1, norm));
                let v = cast((seeded(&kv_shape, c.seed + 2) * norm.min(1e4)).expect("v"));
                for backend in BACKENDS {
                    let out = attention(&q, &k, &v, mask.as_ref(), scale, backend, Weights::Skip).expect("attention").output;
                    prop_assert_eq!(out.dtype(), dtype);
                    check_output(&out, &live, &format!("{backend:?} {dtype:?} logits <= {bound:e}"))?;
                }
                let got = attention(&q, &k, &v, mask.as_ref(), scale, Backend::Reference, Weights::Return).expect("weights");
                let (out, w) = (got.output, got.weights.expect("weights were asked for"));
                let what = format!("weights {dtype:?} logits <= {bound:e}");
                check_output(&out, &live, &what)?;
                check_output(&w, &live, &what)?;
            }
        }
    }

    #[test]
    fn cross_attention_is_finite_and_dead_rows_zero(c in module_cases()) {
        let heads = c.kv_heads * c.groups;
        let (qd, md) = (heads * c.head_dim, 6);
        let bq = c.batch_k * c.r;
        let mask = c.mask.build(bq, c.q_len, c.mem_len, c.seed);
        let live = attending(mask.as_ref(), bq, c.q_len, c.mem_len);
        let cfg = CrossAttentionConfig { num_kv_heads: c.kv_heads, ..CrossAttentionConfig::new(qd, md, heads) };
        for dtype in DTYPES {
            let vars = VarMap::new();
            CrossAttention::load(vb(&vars, dtype), &cfg).expect("init");
            normalise_weights(&vars);
            // Plain tensors: `Backend::Fused` runs the fused kernel (it
            // refuses, with an error, weights that track gradients).
            let attn = CrossAttention::load(frozen(&vars, dtype), &cfg).expect("load");
            for &bound in logit_bounds(dtype) {
                // Projections keep norms at most about 1: inputs of norm
                // sqrt(bound) give logits up to about bound / sqrt(head_dim).
                let norm = bound.sqrt();
                let q = rows_of_norm(&[bq, c.q_len, qd], c.seed, norm).to_dtype(dtype).expect("q");
                let m = rows_of_norm(&[c.batch_k, c.mem_len, md], c.seed + 1, norm).to_dtype(dtype).expect("m");
                for backend in BACKENDS {
                    let a = attn.clone().with_backend(backend);
                    let what = format!("cross {backend:?} {dtype:?} logits <= {bound:e}");
                    check_output(&a.forward(&q, &m, mask.as_ref()).expect("forward"), &live, &what)?;
                    let kv = a.project_memory(&m).expect("kv");
                    check_output(&a.attend(&q, &kv, mask.as_ref(), Weights::Skip).expect("cached").output, &live, &what)?;
                }
                let kv = attn.project_memory(&m).expect("kv");
                let got = attn.attend(&q, &kv, mask.as_ref(), Weights::Return).expect("weights");
                let (out, w) = (got.output, got.weights.expect("weights were asked for"));
                let what = format!("cross weights {dtype:?} logits <= {bound:e}");
                check_output(&out, &live, &what)?;
                check_output(&w, &live, &what)?;
            }
        }
    }

    #[test]
    fn self_attention_is_finite_and_dead_rows_zero(c in module_cases()) {
        let heads = c.kv_heads * c.groups;
        let hidden = heads * c.head_dim;
        let b = c.batch_k * c.r;
        let t = c.q_len;
        let key_mask = c.mask.build(b, t, t, c.seed);
        let causal = Mask::new(mask::causal(t, &Device::Cpu).expect("causal")).expect("mask");
        let combined = match &key_mask {
            None => causal,
            Some(m) => causal.and(m).expect("and"),
        };
        let live = attending(Some(&combined), b, t, t);
        let cfg = SelfAttentionConfig { num_kv_heads: c.kv_heads, ..SelfAttentionConfig::new(hidden, heads) };
        for dtype in DTYPES {
            let vars = VarMap::new();
            CausalSelfAttention::load(vb(&vars, dtype), &cfg).expect("init");
            normalise_weights(&vars);
            let attn = CausalSelfAttention::load(frozen(&vars, dtype), &cfg).expect("load");
            for &bound in logit_bounds(dtype) {
                let x = rows_of_norm(&[b, t, hidden], c.seed, bound.sqrt()).to_dtype(dtype).expect("x");
                for backend in BACKENDS {
                    let a = attn.clone().with_backend(backend);
                    let what = format!("self {backend:?} {dtype:?} logits <= {bound:e}");
                    check_output(&a.forward(&x, key_mask.as_ref()).expect("forward"), &live, &what)?;
                    // A prompt, then one token at a time through the cache.
                    let p = t.div_ceil(2);
                    let mut cache = KvCache::new(1).expect("cache");
                    let step_mask = |from: usize, len: usize| {
                        key_mask.as_ref().map(|m| {
                            let (_, mq, _) = m.dims();
                            let rows = if mq == 1 { m.tensor().clone() } else { m.tensor().narrow(1, from, len).expect("rows") };
                            Mask::new(rows.narrow(2, 0, from + len).expect("keys")).expect("mask")
                        })
                    };
                    let mut outs = vec![a.attend(&x.narrow(1, 0, p).expect("prompt"), Some(&mut cache), step_mask(0, p).as_ref(), Weights::Skip).expect("prompt").output];
                    for i in p..t {
                        outs.push(a.attend(&x.narrow(1, i, 1).expect("step"), Some(&mut cache), step_mask(i, 1).as_ref(), Weights::Skip).expect("step").output);
                    }
                    check_output(&Tensor::cat(&outs, 1).expect("cat"), &live, &format!("{what}, cached"))?;
                }
            }
        }
    }
}
