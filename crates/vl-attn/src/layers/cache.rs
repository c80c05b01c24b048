//! The text key/value cache of causal self-attention.

use candle_core::Tensor;

use crate::error::{AttnError, Result};

/// Keys and values of the tokens seen so far, `(batch, kv_heads, len,
/// head_dim)`, in a preallocated buffer that doubles when full (amortised
/// O(1) append).
///
/// Not `Clone`: the buffer is written in place, so two caches must never
/// share it. Use [`KvCache::index_select`] to reorder or duplicate rows
/// (beam search).
#[derive(Debug)]
pub struct KvCache {
    k: Option<Tensor>,
    v: Option<Tensor>,
    len: usize,
    initial_capacity: usize,
}

impl KvCache {
    /// The most tokens a cache holds: 2^24 (16,777,216), far past any
    /// model's positions, and small enough that a buffer's element count
    /// `batch * kv_heads * capacity * head_dim` is checked, not wrapped.
    pub const MAX_CAPACITY: usize = 1 << 24;

    /// An empty cache that allocates room for `capacity` tokens on first
    /// append (e.g. the model's maximum positions).
    ///
    /// # Errors
    /// [`AttnError::Argument`] naming `capacity` when it is past
    /// [`KvCache::MAX_CAPACITY`].
    pub fn new(capacity: usize) -> Result<Self> {
        if capacity > Self::MAX_CAPACITY {
            return Err(AttnError::Argument {
                arg: "capacity",
                reason: format!(
                    "expected at most {} tokens (KvCache::MAX_CAPACITY), got {capacity}",
                    Self::MAX_CAPACITY
                ),
            });
        }
        Ok(Self {
            k: None,
            v: None,
            len: 0,
            initial_capacity: capacity.max(1),
        })
    }

    /// Tokens cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Tokens the buffer holds before it must grow.
    pub fn capacity(&self) -> usize {
        self.k
            .as_ref()
            .map_or(self.initial_capacity, |k| k.dims()[2])
    }

    /// Forgets every token; the buffer is kept for reuse.
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// The cached keys and values, `(batch, kv_heads, len, head_dim)`, or
    /// `None` before the first append.
    pub fn current(&self) -> Result<Option<(Tensor, Tensor)>> {
        match (&self.k, &self.v) {
            (Some(k), Some(v)) => Ok(Some((k.narrow(2, 0, self.len)?, v.narrow(2, 0, self.len)?))),
            _ => Ok(None),
        }
    }

    /// Appends `k` and `v` `(batch, kv_heads, new, head_dim)` and returns all
    /// cached keys and values, `(batch, kv_heads, len + new, head_dim)`.
    ///
    /// # Errors
    /// [`AttnError::Shape`] naming `k` or `v` when they do not match each
    /// other or the cache; [`AttnError::Argument`] naming `k` when `len +
    /// new` passes [`KvCache::MAX_CAPACITY`] or the grown buffer's element
    /// count overflows `usize`.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, h, t, d) = k.dims4()?;
        if v.dims() != k.dims() {
            return Err(AttnError::Shape {
                arg: "v",
                expected: format!("{:?} like k", k.dims()),
                actual: v.dims().to_vec(),
            });
        }
        if let Some(buf) = &self.k {
            let (bb, bh, _, bd) = buf.dims4()?;
            if (bb, bh, bd) != (b, h, d) || buf.dtype() != k.dtype() {
                return Err(AttnError::Shape {
                    arg: "k",
                    expected: format!("({bb}, {bh}, new, {bd}) {:?} like the cache", buf.dtype()),
                    actual: k.dims().to_vec(),
                });
            }
        }
        let needed = self.len + t; // both at most MAX_CAPACITY: no overflow
        if needed > self.capacity() || self.k.is_none() {
            if needed > Self::MAX_CAPACITY {
                return Err(AttnError::Argument {
                    arg: "k",
                    reason: format!(
                        "{t} new tokens after {} would pass KvCache::MAX_CAPACITY {}",
                        self.len,
                        Self::MAX_CAPACITY
                    ),
                });
            }
            let grown = if self.k.is_some() {
                self.capacity() * 2
            } else {
                self.capacity()
            };
            let cap = needed.max(grown).min(Self::MAX_CAPACITY);
            if [h, cap, d]
                .iter()
                .try_fold(b, |acc, &n| acc.checked_mul(n))
                .is_none()
            {
                return Err(AttnError::Argument {
                    arg: "k",
                    reason: format!(
                        "a cache buffer ({b}, {h}, {cap}, {d}) overflows the address space"
                    ),
                });
            }
            self.k = Some(grow(self.k.as_ref(), self.len, (b, h, cap, d), k)?);
            self.v = Some(grow(self.v.as_ref(), self.len, (b, h, cap, d), v)?);
        }
        let (kb, vb) = match (&self.k, &self.v) {
            (Some(kb), Some(vb)) => (kb, vb),
            _ => unreachable!("buffers allocated above"),
        };
        kb.slice_set(&k.contiguous()?, 2, self.len)?;
        vb.slice_set(&v.contiguous()?, 2, self.len)?;
        self.len += t;
        Ok((kb.narrow(2, 0, self.len)?, vb.narrow(2, 0, self.len)?))
    }

    /// Keeps the batch rows at `indices` (a `u32` tensor), in that order;
    /// rows may repeat (beam search).
    pub fn index_select(&mut self, indices: &Tensor) -> Result<()> {
        let (Some(k), Some(v)) = (&self.k, &self.v) else {
            return Ok(());
        };
        let select = |buf: &Tensor| -> Result<Tensor> {
            let (_, h, cap, d) = buf.dims4()?;
            let kept = buf
                .narrow(2, 0, self.len)?
                .contiguous()?
                .index_select(indices, 0)?;
            let out = Tensor::zeros((indices.elem_count(), h, cap, d), buf.dtype(), buf.device())?;
            out.slice_set(&kept, 2, 0)?;
            Ok(out)
        };
        let (k, v) = (select(k)?, select(v)?);
        self.k = Some(k);
        self.v = Some(v);
        Ok(())
    }
}

/// A zeroed buffer of `shape` holding the first `len` tokens of `old`.
fn grow(
    old: Option<&Tensor>,
    len: usize,
    shape: (usize, usize, usize, usize),
    like: &Tensor,
) -> Result<Tensor> {
    let buf = Tensor::zeros(shape, like.dtype(), like.device())?;
    if let Some(old) = old {
        if len > 0 {
            buf.slice_set(&old.narrow(2, 0, len)?.contiguous()?, 2, 0)?;
        }
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// An absurd capacity is refused, naming `capacity`, instead of
    /// aborting on the first append's allocation.
    #[test]
    fn absurd_capacity_is_an_error() -> Result<()> {
        for capacity in [KvCache::MAX_CAPACITY + 1, usize::MAX] {
            let err = KvCache::new(capacity)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(
                err.starts_with("capacity:") && err.contains(&capacity.to_string()),
                "{err}"
            );
        }
        let cache = KvCache::new(KvCache::MAX_CAPACITY)?;
        assert_eq!(cache.capacity(), KvCache::MAX_CAPACITY);
        Ok(())
    }

    /// Appending past the capacity limit is an error naming `k`; tokens
    /// broadcast from one element, so that nothing is allocated.
    #[test]
    fn append_past_the_limit_is_an_error() -> Result<()> {
        let dev = Device::Cpu;
        let mut cache = KvCache::new(4)?;
        let big = Tensor::zeros((), DType::F32, &dev)?.broadcast_as((
            1,
            1,
            KvCache::MAX_CAPACITY + 1,
            1,
        ))?;
        let err = cache
            .append(&big, &big)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.starts_with("k:") && err.contains("MAX_CAPACITY"),
            "{err}"
        );
        assert!(cache.is_empty());
        Ok(())
    }
}
