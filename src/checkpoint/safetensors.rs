//! Safetensors weights, read tensor by tensor (no memory map) with every
//! tensor's presence, shape and dtype checked before it is read, and
//! written from a `VarMap`.
//!
//! Every error names the file, and the tensor with the expected and the
//! found shape or dtype.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use half::vec::HalfBitsVecExt;
use vl_attn::named::blocks_name;
use vl_attn::{Quantization, StoredBlocks};

use crate::error::{arg_err, Error, Result};

/// What the checked reader found wrong with a tensor (missing, wrong shape
/// or dtype, unreadable), raised through candle's `VarBuilder` as a typed
/// error and turned into [`Error::Weights`] naming the file by
/// [`crate::error::weights_error`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TensorIssue(pub String);

impl TensorIssue {
    fn into_candle(self) -> candle_core::Error {
        candle_core::Error::WrappedContext {
            wrapped: Box::new(self),
            context: "checked safetensors".into(),
        }
    }

    /// The issue inside a candle error, through candle's context and
    /// backtrace layers; `None` when the error is candle's own.
    pub fn find(e: &candle_core::Error) -> Option<&TensorIssue> {
        match e {
            candle_core::Error::WrappedContext { wrapped, .. } => wrapped.downcast_ref(),
            candle_core::Error::Context { inner, .. }
            | candle_core::Error::WithPath { inner, .. }
            | candle_core::Error::WithBacktrace { inner, .. } => Self::find(inner),
            _ => None,
        }
    }
}

/// One safetensors file, read tensor by tensor.
struct SafetensorsFile {
    file: Mutex<std::fs::File>,
    /// Where the tensor data starts (after the length and the header).
    data_start: u64,
}

/// A tensor's place among the files.
struct Entry {
    file: usize,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    offsets: (usize, usize),
}

/// A safetensors backend that reads each tensor from its file when asked
/// (no memory map, so the process holds one copy of the weights, not the
/// copy plus the mapped file), checks its presence, shape and dtype before
/// reading it, and names the file in every error.
struct CheckedSafetensors {
    files: Vec<SafetensorsFile>,
    entries: HashMap<String, Entry>,
    /// Stored blocks read already to give a module its dense values, kept
    /// until the quantizer takes them (each is read from the file once).
    blocks_read: Mutex<HashMap<String, QTensor>>,
}

impl CheckedSafetensors {
    fn err(&self, reason: String) -> candle_core::Error {
        TensorIssue(reason).into_candle()
    }

    fn open(files: &[PathBuf]) -> Result<Self> {
        let mut opened = Vec::with_capacity(files.len());
        let mut entries = HashMap::new();
        for (i, path) in files.iter().enumerate() {
            let err = |reason: String| Error::Weights {
                path: path.clone(),
                reason,
            };
            let (file, n, header) = check_safetensors_layout(path).map_err(err)?;
            let metadata: safetensors::tensor::Metadata = serde_json::from_slice(&header)
                .map_err(|e| err(format!("not a valid safetensors file: {e}")))?;
            for (name, info) in metadata.tensors() {
                let entry = Entry {
                    file: i,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    offsets: info.data_offsets,
                };
                if entries.insert(name.clone(), entry).is_some() {
                    return Err(err(format!("tensor `{name}` is in more than one file")));
                }
            }
            opened.push(SafetensorsFile {
                file: Mutex::new(file),
                data_start: 8 + n,
            });
        }
        Ok(Self {
            files: opened,
            entries,
            blocks_read: Mutex::default(),
        })
    }

    /// Reads tensor `name`'s bytes into `bytes` (its length).
    fn read_into(&self, name: &str, e: &Entry, bytes: &mut [u8]) -> candle_core::Result<()> {
        use std::io::{Read, Seek, SeekFrom};
        let f = &self.files[e.file];
        let mut file = f
            .file
            .lock()
            .map_err(|_| self.err("the file's lock is poisoned".into()))?;
        file.seek(SeekFrom::Start(f.data_start + e.offsets.0 as u64))
            .and_then(|_| file.read_exact(bytes))
            .map_err(|err| self.err(format!("cannot read tensor `{name}`: {err}")))
    }

    fn read(&self, name: &str, e: &Entry) -> candle_core::Result<Tensor> {
        use safetensors::Dtype;
        let len = e.offsets.1 - e.offsets.0;
        let read = |bytes: &mut [u8]| self.read_into(name, e, bytes);
        // Read straight into the tensor's own buffer (safetensors is
        // little-endian, as every target vl builds for): a byte buffer
        // copied into a typed one afterwards zeroed and wrote every page
        // twice, a third of a vit-gpt2 f32 caption's time in the kernel's
        // page clearing.
        let (shape, cpu) = (e.shape.as_slice(), &Device::Cpu);
        match e.dtype {
            Dtype::F32 => Tensor::from_vec(read_values::<f32>(name, len, read)?, shape, cpu),
            Dtype::F64 => Tensor::from_vec(read_values::<f64>(name, len, read)?, shape, cpu),
            Dtype::F16 => {
                let bits = read_values::<u16>(name, len, read)?;
                Tensor::from_vec(bits.reinterpret_into::<half::f16>(), shape, cpu)
            }
            Dtype::BF16 => {
                let bits = read_values::<u16>(name, len, read)?;
                Tensor::from_vec(bits.reinterpret_into::<half::bf16>(), shape, cpu)
            }
            other => Err(self.err(format!(
                "tensor `{name}` has dtype {other:?}, expected a float (f32, f16, bf16)"
            ))),
        }
    }
}

/// A zeroed `Vec<T>` of `len` bytes (a multiple of `T`'s size: the
/// header's offsets were checked against its shape and dtype) filled by
/// `read` through a byte view; errors name tensor `name`. Zeroed by the allocator (`calloc`), whose
/// fresh pages the kernel clears as the read first touches them.
fn read_values<T: bytemuck::Pod>(
    name: &str,
    len: usize,
    read: impl FnOnce(&mut [u8]) -> candle_core::Result<()>,
) -> candle_core::Result<Vec<T>> {
    let size = std::mem::size_of::<T>();
    if !len.is_multiple_of(size) {
        candle_core::bail!(
            "tensor `{name}`: {len} bytes are not a whole number of {size}-byte values"
        );
    }
    let Ok(mut values) = bytemuck::try_zeroed_vec::<T>(len / size) else {
        candle_core::bail!("tensor `{name}`: cannot allocate {len} bytes");
    };
    read(bytemuck::cast_slice_mut(&mut values))?;
    Ok(values)
}

/// The block formats a weight may be stored in (`name.q8_0`,
/// `name.q4k`: see [`vl_attn::Proj::named_tensors`]).
const BLOCK_FORMATS: [Quantization; 2] = [Quantization::Q8_0, Quantization::Q4K];

impl CheckedSafetensors {
    /// The blocks stored for the weight `name` in `format`, as candle's
    /// tensor of shape `shape`: `None` when the file has none.
    fn stored(
        &self,
        name: &str,
        format: Quantization,
        shape: Option<&Shape>,
    ) -> Option<candle_core::Result<QTensor>> {
        let ggml = format.ggml_dtype()?;
        let key = blocks_name(name, format);
        let e = self.entries.get(&key)?;
        Some((|| {
            let (rows, row_bytes) = match e.shape[..] {
                [r, b] if e.dtype == safetensors::Dtype::U8 => (r, b),
                _ => {
                    return Err(self.err(format!(
                        "tensor `{key}` ({:?} {:?}) is not u8 blocks (rows, bytes per row)",
                        e.dtype, e.shape
                    )))
                }
            };
            let cols = row_bytes / ggml.type_size() * ggml.block_size();
            // A weight of more dimensions (a convolution's `(out, in, k,
            // k)`) is stored as the rows of its first one.
            let fits = |s: &Shape| s.dims().first() == Some(&rows) && s.elem_count() == rows * cols;
            if row_bytes % ggml.type_size() != 0 || shape.is_some_and(|s| !fits(s)) {
                return Err(self.err(format!(
                    "tensor `{key}` holds {rows} rows of {row_bytes} bytes, not {} blocks of {:?}",
                    format,
                    shape.map_or(vec![rows, cols], |s| s.dims().to_vec())
                )));
            }
            let mut bytes = vec![0u8; e.offsets.1 - e.offsets.0];
            self.read_into(&key, e, &mut bytes)?;
            let storage = QStorage::from_data(std::borrow::Cow::Owned(bytes), &Device::Cpu, ggml)?;
            QTensor::new(storage, (rows, cols))
        })())
    }
}

/// The checked reader, shared by the [`VarBuilder`] that reads the dense
/// tensors and the [`vl_attn::Quantizer`] that takes stored blocks.
#[derive(Clone)]
pub struct SharedWeights(Arc<CheckedSafetensors>);

impl StoredBlocks for SharedWeights {
    fn blocks(&self, name: &str, format: GgmlDType) -> Option<vl_attn::Result<QTensor>> {
        let q = Quantization::of(Some(format))?;
        let read = self
            .0
            .blocks_read
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&blocks_name(name, q));
        match read {
            Some(blocks) => Some(Ok(blocks)),
            None => self
                .0
                .stored(name, q, None)
                .map(|r| r.map_err(vl_attn::AttnError::from)),
        }
    }
}

impl SimpleBackend for SharedWeights {
    fn get(
        &self,
        s: Shape,
        name: &str,
        init: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        self.0.get(s, name, init, dtype, dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.0.get_unchecked(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.contains_tensor(name)
    }
}

impl SimpleBackend for CheckedSafetensors {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        // A weight stored as blocks: the values they stand for (the
        // quantizer then takes the blocks themselves).
        if !self.entries.contains_key(name) {
            for format in BLOCK_FORMATS {
                if let Some(q) = self.stored(name, format, Some(&s)) {
                    let q = q?;
                    let values = q.dequantize(dev)?.to_dtype(dtype)?.reshape(&s)?;
                    self.blocks_read
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .insert(blocks_name(name, format), q);
                    return Ok(values);
                }
            }
        }
        let e = self.entries.get(name).ok_or_else(|| {
            self.err(format!(
                "missing tensor `{name}` (expected shape {:?})",
                s.dims()
            ))
        })?;
        if e.shape != s.dims() {
            return Err(self.err(format!(
                "tensor `{name}` has shape {:?}, expected {:?}",
                e.shape,
                s.dims()
            )));
        }
        self.read(name, e)?.to_device(dev)?.to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| self.err(format!("missing tensor `{name}`")))?;
        self.read(name, e)?.to_device(dev)?.to_dtype(dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.entries.contains_key(name)
            || BLOCK_FORMATS
                .iter()
                .any(|f| self.entries.contains_key(&format!("{name}.{}", f.name())))
    }
}

/// The largest safetensors header read, in bytes (the safetensors crate's
/// own limit).
const MAX_SAFETENSORS_HEADER: u64 = 100_000_000;

/// Checks that `path` is a file whose safetensors header fits in it, whose
/// tensors' byte ranges fit their dtype and shape, and whose data is all
/// there, so that a damaged file is reported with what its header promises
/// and what the file holds. Returns the open file, the header's length and
/// its bytes, or the reason.
fn check_safetensors_layout(
    path: &Path,
) -> std::result::Result<(std::fs::File, u64, Vec<u8>), String> {
    use serde::Deserialize;
    use std::io::Read;
    if path.is_dir() {
        return Err("is a directory, expected a safetensors file".into());
    }
    if !path.is_file() {
        return Err("no such file".into());
    }
    let mut file = std::fs::File::open(path).map_err(|e| format!("cannot open: {e}"))?;
    let len = file
        .metadata()
        .map_err(|e| format!("cannot read: {e}"))?
        .len();
    let mut n = [0u8; 8];
    if len < 8 {
        return Err(format!(
            "is {len} bytes, too short for the 8-byte header length of a safetensors file"
        ));
    }
    file.read_exact(&mut n)
        .map_err(|e| format!("cannot read: {e}"))?;
    let n = u64::from_le_bytes(n);
    if n > len - 8 {
        return Err(format!(
            "truncated or not safetensors: the header length says {n} bytes, but only {} bytes follow it",
            len - 8
        ));
    }
    if n > MAX_SAFETENSORS_HEADER {
        return Err(format!(
            "the header length {n} is larger than the {MAX_SAFETENSORS_HEADER} bytes a safetensors header may have"
        ));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header)
        .map_err(|e| format!("cannot read: {e}"))?;
    let entries: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| {
            format!("not a valid safetensors file: the {n}-byte header is not a JSON object: {e}")
        })?;
    let mut data_end = 0;
    for (name, t) in &entries {
        let Ok(t) = TensorInfo::deserialize(t) else {
            continue;
        };
        let [start, end] = t.data_offsets;
        data_end = data_end.max(end);
        let Some(size) = safetensors_dtype_size(&t.dtype) else {
            continue;
        };
        let Some(expected) = t.shape.iter().try_fold(size, |n, d| n.checked_mul(*d)) else {
            continue;
        };
        if end.checked_sub(start) != Some(expected) {
            return Err(format!(
                "tensor `{name}` of dtype {} and shape {:?} needs {expected} bytes, \
                 its data_offsets [{start}, {end}] hold {}",
                t.dtype,
                t.shape,
                i128::from(end) - i128::from(start)
            ));
        }
    }
    let expected = (8 + n).saturating_add(data_end);
    if expected > len {
        return Err(format!(
            "truncated: the header describes {expected} bytes, the file has {len}"
        ));
    }
    Ok((file, n, header))
}

/// A tensor's entry in a safetensors header.
#[derive(serde::Deserialize)]
struct TensorInfo {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

/// Bytes per element of a safetensors dtype; `None` for sub-byte or unknown
/// ones.
fn safetensors_dtype_size(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" => 1,
        "U16" | "I16" | "F16" | "BF16" => 2,
        "U32" | "I32" | "F32" => 4,
        "U64" | "I64" | "F64" => 8,
        _ => return None,
    })
}

/// Opens safetensors files as a checked [`VarBuilder`]: headers are read
/// and checked now, each tensor is read from its file when the model asks
/// for it. A tensor that is missing, of the wrong shape or dtype, or
/// unreadable is raised as a [`TensorIssue`]: map the model's load error
/// through [`crate::error::weights_error`] to name the file.
pub fn open_weights(
    files: &[PathBuf],
    dtype: DType,
    device: &Device,
) -> Result<VarBuilder<'static>> {
    Ok(open_shared(files, dtype, device)?.0)
}

/// [`open_weights`], with the reader shared for the blocks a converted
/// model stored ([`SharedWeights`]).
pub fn open_shared(
    files: &[PathBuf],
    dtype: DType,
    device: &Device,
) -> Result<(VarBuilder<'static>, SharedWeights)> {
    if files.is_empty() {
        return arg_err("weights", "no safetensors file given");
    }
    let shared = SharedWeights(Arc::new(CheckedSafetensors::open(files)?));
    let vb = VarBuilder::from_backend(Box::new(shared.clone()), dtype, device.clone());
    Ok((vb, shared))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every float dtype reads back bit for bit, at odd sizes, in any
    /// order (the reader seeks to each tensor), including a tensor with no
    /// elements; a wider dtype asked of the builder is a conversion.
    #[test]
    fn tensors_of_every_float_dtype_read_back_exactly() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let base = Tensor::arange(0f32, 35.0, &dev)?
            .affine(0.37, -5.3)?
            .reshape((5, 7))?;
        let tensors: HashMap<String, Tensor> = [
            ("f32", base.clone()),
            ("f64", base.to_dtype(DType::F64)?),
            ("f16", base.to_dtype(DType::F16)?),
            ("bf16", base.to_dtype(DType::BF16)?),
            ("odd", Tensor::arange(-3f32, 0.0, &dev)?),
            ("empty", Tensor::zeros((0, 4), DType::BF16, &dev)?),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("w.safetensors");
        candle_core::safetensors::save(&tensors, &path)?;
        let vb = open_weights(&[path], DType::F32, &dev)?;
        for name in ["odd", "bf16", "f32", "empty", "f16", "f64"] {
            let want = &tensors[name];
            let got = vb.get_unchecked_dtype(name, want.dtype())?;
            assert_eq!(
                (got.dims(), got.dtype()),
                (want.dims(), want.dtype()),
                "{name}"
            );
            let bits = |t: &Tensor| -> anyhow::Result<Vec<u64>> {
                let t = t.flatten_all()?.to_dtype(DType::F64)?;
                Ok(t.to_vec1::<f64>()?.iter().map(|v| v.to_bits()).collect())
            };
            assert_eq!(bits(&got)?, bits(want)?, "{name}");
        }
        let wide = vb.get_unchecked_dtype("bf16", DType::F32)?;
        assert_eq!(
            wide.to_vec2::<f32>()?,
            tensors["bf16"].to_dtype(DType::F32)?.to_vec2::<f32>()?
        );
        Ok(())
    }
}
