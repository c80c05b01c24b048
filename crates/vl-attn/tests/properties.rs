//! Property tests over random shapes, heads and masks.
#![allow(missing_docs)]
//!
//! Tolerances: f32 paths agree within 1e-5 (max abs diff on outputs of
//! magnitude ~1); f16 within 2e-2 and bf16 within 1e-1 of f32.

mod common;

use candle_core::{DType, Device, IndexOp, Tensor};
use candle_nn::VarMap;
use common::*;
use proptest::prelude::*;
use vl_attn::attention::{attention, Backend, Weights};
use vl_attn::{CrossAttention, CrossAttentionConfig, Mask};

#[derive(Debug, Clone)]
struct Case {
    batch_k: usize,
    r: usize,
    kv_heads: usize,
    groups: usize,
    q_len: usize,
    k_len: usize,
    head_dim: usize,
    density: f32,
    per_query: bool,
    seed: u64,
}

fn cases() -> impl Strategy<Value = Case> {
    (
        1usize..3,
        1usize..3,
        1usize..3,
        1usize..3,
        // Short blocks (one row at a time) and long ones (tiled: past one
        // task of 32 rows and one block of 256 keys).
        prop_oneof![3 => 1usize..6, 1 => 30usize..40],
        prop_oneof![3 => 1usize..20, 1 => 250usize..270],
        prop_oneof![Just(1usize), Just(4), Just(16), Just(24), Just(64)],
        0.0f32..1.0,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(
            |(batch_k, r, kv_heads, groups, q_len, k_len, head_dim, density, per_query, seed)| {
                Case {
                    batch_k,
                    r,
                    kv_heads,
                    groups,
                    q_len,
                    k_len,
                    head_dim,
                    density,
                    per_query,
                    seed,
                }
            },
        )
}

impl Case {
    fn tensors(&self) -> (Tensor, Tensor, Tensor, Mask) {
        let bq = self.batch_k * self.r;
        let h = self.kv_heads * self.groups;
        let q = seeded(&[bq, h, self.q_len, self.head_dim], self.seed);
        let k = seeded(
            &[self.batch_k, self.kv_heads, self.k_len, self.head_dim],
            self.seed + 1,
        );
        let v = seeded(
            &[self.batch_k, self.kv_heads, self.k_len, self.head_dim],
            self.seed + 2,
        );
        let mq = if self.per_query { self.q_len } else { 1 };
        let m = Mask::new(seeded_mask(
            &[bq, mq, self.k_len],
            self.seed + 3,
            self.density,
        ))
        .expect("mask");
        (q, k, v, m)
    }

    fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn fused_equals_reference(c in cases()) {
        let (q, k, v, m) = c.tensors();
        for mask in [None, Some(&m)] {
            let a = attention(&q, &k, &v, mask, c.scale(), Backend::Fused, Weights::Skip).unwrap().output;
            let b = attention(&q, &k, &v, mask, c.scale(), Backend::Reference, Weights::Skip).unwrap().output;
            prop_assert!(max_abs_diff(&a, &b) <= 1e-5);
            prop_assert!(all_finite(&a));
        }
    }

    #[test]
    fn weight_rows_sum_to_one_or_zero(c in cases()) {
        let (q, k, v, m) = c.tensors();
        let w = attention(&q, &k, &v, Some(&m), c.scale(), Backend::Reference, Weights::Return)
            .unwrap()
            .weights
            .unwrap();
        let sums = w.sum(3).unwrap(); // (bq, h, tq)
        let any = m.tensor().max_keepdim(2).unwrap().to_dtype(DType::F32).unwrap(); // (bq, mq, 1)
        let want = any.squeeze(2).unwrap().unsqueeze(1).unwrap().broadcast_as(sums.shape()).unwrap();
        prop_assert!(max_abs_diff(&sums, &want) <= 1e-5);
        prop_assert!(all_finite(&w));
    }

    #[test]
    fn masked_keys_change_nothing(c in cases()) {
        let (q, k, v, m) = c.tensors();
        // Replace with garbage every key and value that no query may see:
        // a key of memory sample `kb` is read by the `r` query samples
        // `kb * r..(kb + 1) * r`, so it is hidden when none of their queries
        // may attend to it. Every case checks, shared keys (r > 1) included.
        let (bq, _, tk) = m.dims();
        prop_assert_eq!(bq, c.batch_k * c.r);
        // (bq, mq, tk) -> (bq, 1, tk) -> (batch_k, r, tk) -> (batch_k, 1, tk)
        let seen = m.tensor().max_keepdim(1).unwrap()
            .reshape((c.batch_k, c.r, tk)).unwrap()
            .max_keepdim(1).unwrap();
        // (batch_k, 1, tk, 1) over (batch_k, kv_heads, tk, head_dim)
        let hidden = seen.eq(0u8).unwrap().reshape((c.batch_k, 1, tk, 1)).unwrap()
            .broadcast_as(k.shape()).unwrap();
        let junk = (seeded(k.dims(), c.seed + 9) * 1e3).unwrap();
        let k2 = hidden.where_cond(&junk, &k).unwrap();
        let v2 = hidden.where_cond(&junk, &v).unwrap();
        for backend in [Backend::Fused, Backend::Reference] {
            let a = attention(&q, &k, &v, Some(&m), c.scale(), backend, Weights::Skip).unwrap().output;
            let b = attention(&q, &k2, &v2, Some(&m), c.scale(), backend, Weights::Skip).unwrap().output;
            prop_assert!(max_abs_diff(&a, &b) <= 1e-5);
        }
    }

    #[test]
    fn permuting_memory_changes_nothing(c in cases()) {
        let (q, k, v, m) = c.tensors();
        let perm: Vec<u32> = (0..c.k_len as u32).rev().collect();
        let idx = Tensor::new(perm, &Device::Cpu).unwrap();
        let mp = Mask::new(m.tensor().index_select(&idx, 2).unwrap()).unwrap();
        let a = attention(&q, &k, &v, Some(&m), c.scale(), Backend::Fused, Weights::Skip).unwrap().output;
        let b = attention(&q, &k.index_select(&idx, 2).unwrap(), &v.index_select(&idx, 2).unwrap(), Some(&mp), c.scale(), Backend::Fused, Weights::Skip).unwrap().output;
        prop_assert!(max_abs_diff(&a, &b) <= 1e-5);
    }

    #[test]
    fn batch_equals_per_sample(c in cases()) {
        let (q, k, v, m) = c.tensors();
        let all = attention(&q, &k, &v, Some(&m), c.scale(), Backend::Fused, Weights::Skip).unwrap().output;
        for b in 0..c.batch_k * c.r {
            let kb = b / c.r;
            let one = attention(
                &q.i(b..b + 1).unwrap(),
                &k.i(kb..kb + 1).unwrap(),
                &v.i(kb..kb + 1).unwrap(),
                Some(&Mask::new(m.tensor().i(b..b + 1).unwrap()).unwrap()),
                c.scale(),
                Backend::Reference,
                Weights::Skip,
            ).unwrap().output;
            prop_assert!(max_abs_diff(&all.i(b..b + 1).unwrap(), &one) <= 1e-5);
        }
    }

    #[test]
    fn half_precision_is_close_to_f32(c in cases()) {
        let (q, k, v, m) = c.tensors();
        let want = attention(&q, &k, &v, Some(&m), c.scale(), Backend::Reference, Weights::Skip).unwrap().output;
        for (dtype, tol) in [(DType::F16, 2e-2f32), (DType::BF16, 1e-1)] {
            let cast = |t: &Tensor| t.to_dtype(dtype).unwrap();
            for backend in [Backend::Fused, Backend::Reference] {
                let got = attention(&cast(&q), &cast(&k), &cast(&v), Some(&m), c.scale(), backend, Weights::Skip).unwrap().output;
                prop_assert_eq!(got.dtype(), dtype);
                prop_assert!(all_finite(&got));
                prop_assert!(max_abs_diff(&got, &want) <= tol, "{:?} {:?}", dtype, backend);
            }
        }
    }

    #[test]
    fn gqa_equals_mha_with_repeated_kv(
        kv_heads in 1usize..3, groups in 1usize..4, q_len in 1usize..5, m_len in 1usize..12, seed in any::<u64>()
    ) {
        let head_dim = 4;
        let heads = kv_heads * groups;
        let (qd, md) = (heads * head_dim, 6);
        let vars = VarMap::new();
        let gqa_cfg = CrossAttentionConfig { num_kv_heads: kv_heads, ..CrossAttentionConfig::new(qd, md, heads) };
        let gqa = CrossAttention::load(vb(&vars, DType::F32), &gqa_cfg).unwrap();
        // The MHA twin: k/v projections repeat each kv head's rows `groups` times.
        let data = vars.data().lock().unwrap();
        let repeat_rows = |name: &str| -> Tensor {
            let t = data[name].as_tensor().clone();
            let rest: Vec<usize> = t.dims()[1..].to_vec();
            let mut shape = vec![kv_heads, 1, head_dim];
            shape.extend(&rest);
            let mut out = vec![kv_heads, groups, head_dim];
            out.extend(&rest);
            let mut flat = vec![heads * head_dim];
            flat.extend(&rest);
            t.reshape(shape).unwrap().broadcast_as(out).unwrap().reshape(flat).unwrap()
        };
        let lin = |w: &str, b: &str| candle_nn::Linear::new(repeat_rows(w), Some(repeat_rows(b)));
        let same = |w: &str, b: &str| candle_nn::Linear::new(data[w].as_tensor().clone(), Some(data[b].as_tensor().clone()));
        let mha = CrossAttention::from_parts(
            same("q_proj.weight", "q_proj.bias"),
            lin("k_proj.weight", "k_proj.bias"),
            lin("v_proj.weight", "v_proj.bias"),
            same("o_proj.weight", "o_proj.bias"),
            &CrossAttentionConfig::new(qd, md, heads),
        ).unwrap();
        drop(data);
        let q = seeded(&[2, q_len, qd], seed);
        let mem = seeded(&[2, m_len, md], seed + 1);
        let a = gqa.forward(&q, &mem, None).unwrap();
        let b = mha.forward(&q, &mem, None).unwrap();
        prop_assert!(max_abs_diff(&a, &b) <= 1e-5);
    }
}
