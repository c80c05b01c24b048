//! Buffers that start on a cache line.
//!
//! A `Vec` is aligned to its element only, and glibc's large allocations
//! (`mmap`ed) start 16 bytes past a page: every 64-byte vector load of
//! such a buffer then straddles two cache lines. For the packed operands
//! that vl's kernels read with full-width loads, that cost the f32 GEMM
//! 8–12% of its speed (`bench_gemm`, Xeon model 167): they live in a
//! [`CacheAligned`] instead.

use std::mem::MaybeUninit;
use std::ops::{Deref, DerefMut};

/// Bytes of a cache line: the alignment of a [`CacheAligned`]'s first
/// element.
const LINE: usize = 64;

/// `len` values of `T` from a 64-byte boundary: a `Vec` with room to skip
/// to the boundary.
#[derive(Debug)]
pub(crate) struct CacheAligned<T> {
    buf: Vec<T>,
    start: usize,
    len: usize,
}

impl<T: Copy + Default> CacheAligned<T> {
    /// Elements of room to skip to the boundary: a line's worth.
    const SLACK: usize = LINE / size_of::<T>();

    /// Where the boundary lies from `buf` (a buffer of `len + SLACK`
    /// elements).
    fn start(buf: *const T) -> usize {
        let start = buf.align_offset(LINE);
        // `align_offset` finds the boundary within a line's worth of
        // elements for every primitive `T` (its size divides 64).
        assert!(
            start <= Self::SLACK,
            "CacheAligned: no 64-byte boundary in reach"
        );
        start
    }

    /// `len` default values (zeros for vl's numeric types), the first on
    /// a cache line.
    pub(crate) fn new(len: usize) -> Self {
        Self::filled(len, T::default())
    }

    /// `len` copies of `value`, the first on a cache line.
    pub(crate) fn filled(len: usize, value: T) -> Self {
        let buf = vec![value; len + Self::SLACK];
        let start = Self::start(buf.as_ptr());
        Self { buf, start, len }
    }

    /// `len` values from a cache line, written by `fill` (handed them
    /// uninitialised): for a packer that writes every value of its output,
    /// which would otherwise be zeroed first for nothing.
    ///
    /// # Safety
    /// `fill` initialises every element of the slice it is given.
    pub(crate) unsafe fn written_by(len: usize, fill: impl FnOnce(&mut [MaybeUninit<T>])) -> Self {
        let mut buf: Vec<T> = Vec::with_capacity(len + Self::SLACK);
        let start = Self::start(buf.as_ptr());
        let spare = &mut buf.spare_capacity_mut()[..len + Self::SLACK];
        let (before, rest) = spare.split_at_mut(start);
        let (values, after) = rest.split_at_mut(len);
        for v in before.iter_mut().chain(after) {
            v.write(T::default());
        }
        fill(values);
        // SAFETY: the slack around the `len` values is written above, and
        // the `len` by `fill` (the caller's contract).
        unsafe { buf.set_len(len + Self::SLACK) };
        Self { buf, start, len }
    }
}

impl<T> Deref for CacheAligned<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.start..self.start + self.len]
    }
}

impl<T> DerefMut for CacheAligned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

impl<'a, T> IntoIterator for &'a CacheAligned<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_on_a_line_with_its_length_zeroed() {
        for len in [0, 1, 15, 16, 17, 1000, 1 << 20] {
            let f = CacheAligned::<f32>::new(len);
            assert_eq!(f.len(), len);
            assert!(f.iter().all(|&v| v == 0.0));
            if len > 0 {
                assert_eq!(f.as_ptr() as usize % LINE, 0, "f32 × {len}");
            }
            let b = CacheAligned::<u8>::filled(len, 128);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&v| v == 128));
            if len > 0 {
                assert_eq!(b.as_ptr() as usize % LINE, 0, "u8 × {len}");
            }
        }
    }

    #[test]
    fn written_by_holds_what_fill_wrote_on_a_line() {
        for len in [0, 1, 17, 4096] {
            // SAFETY: the closure writes every element.
            let a = unsafe {
                CacheAligned::<f32>::written_by(len, |v| {
                    for (i, v) in v.iter_mut().enumerate() {
                        v.write(i as f32);
                    }
                })
            };
            assert_eq!(a.len(), len);
            assert!(a.iter().enumerate().all(|(i, &v)| v == i as f32));
            if len > 0 {
                assert_eq!(a.as_ptr() as usize % LINE, 0);
            }
        }
    }
}
