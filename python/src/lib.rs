//! `vl._vl`: the native half of the `vl` Python package. It loads a model
//! (`load`) and captions Python inputs with vl's [`Captioner`]: paths,
//! `bytes`, PIL images and NumPy `uint8` arrays `(H, W, 3)` (read in place
//! when C-contiguous), the GIL released while vl computes. The package's
//! Python half (`vl/__init__.py`) adds the documented `Model`, the
//! generator form, `vl.pipeline` and `vl.ray`; the exceptions live there
//! (`vl/_errors.py`) so that they can also be `ValueError`s and
//! `TypeError`s.

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::{DType, Device};
use numpy::{PyArrayDescrMethods, PyReadonlyArray3, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString};
use vl::captioner::{Captioner, ImageInput, Request};
use vl::settings::{GenerationOverrides, OverrideError};
use vl::tasks::Task;
use vl::vl_attn::Quantization;
use vl::vl_vision::VisionError;
use vl::{LoadOptions, Source};

/// The Python exception class (in `vl._errors`) for an error of vl's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `vl.Error`: anything else (a failed computation).
    Error,
    /// `vl.ArgumentError` (also a `ValueError`).
    Argument,
    /// `vl.InputTypeError` (also a `TypeError`).
    InputType,
    /// `vl.ImageError`: an image could not be read or used.
    Image,
    /// `vl.ModelError`: a checkpoint could not be loaded.
    Model,
}

impl Kind {
    fn class(self) -> &'static str {
        match self {
            Self::Error => "Error",
            Self::Argument => "ArgumentError",
            Self::InputType => "InputTypeError",
            Self::Image => "ImageError",
            Self::Model => "ModelError",
        }
    }

    /// The class of vl's error `e`.
    fn of(e: &vl::Error) -> Self {
        use vl::vl_decoder::DecoderError;
        use vl::Error as E;
        match e {
            E::Vision(VisionError::Image { .. }) => Self::Image,
            E::Argument { arg: "image", .. }
            | E::Vision(VisionError::Argument { arg: "image", .. }) => Self::Image,
            E::Argument { .. }
            | E::Decoder(DecoderError::Argument { .. })
            | E::Vision(VisionError::Argument { .. }) => Self::Argument,
            E::Config { .. }
            | E::Io { .. }
            | E::Json { .. }
            | E::Weights { .. }
            | E::Tokenizer { .. }
            | E::UnsupportedModel { .. }
            | E::Decoder(DecoderError::Config { .. })
            | E::Vision(VisionError::Config { .. }) => Self::Model,
            _ => Self::Error,
        }
    }
}

/// An instance of `kind`'s class with `message`.
fn exception(py: Python<'_>, kind: Kind, message: String) -> PyErr {
    let made = py
        .import("vl._errors")
        .and_then(|m| m.getattr(kind.class()))
        .and_then(|class| class.call1((message.clone(),)));
    match made {
        Ok(instance) => PyErr::from_value(instance),
        // The package's Python half is missing (the module imported
        // alone): still an exception with vl's message.
        Err(_) => PyErr::new::<pyo3::exceptions::PyRuntimeError, _>(message),
    }
}

fn vl_err(py: Python<'_>, e: &vl::Error) -> PyErr {
    exception(py, Kind::of(e), e.to_string())
}

fn argument(py: Python<'_>, message: impl Into<String>) -> PyErr {
    exception(py, Kind::Argument, message.into())
}

/// vl's thread count for this process, once set.
static THREADS: OnceLock<usize> = OnceLock::new();

/// Sizes the process's CPU thread pools (vl's kernels run on rayon's
/// global pool; candle's matrix products read `RAYON_NUM_THREADS`, which
/// the Python half sets first). Once per process: a second, different
/// count is refused, since the pools already run.
#[pyfunction]
fn set_threads(py: Python<'_>, n: usize) -> PyResult<()> {
    if n == 0 {
        return Err(argument(py, "threads=0: must be at least 1"));
    }
    let set = *THREADS.get_or_init(|| {
        // Fails only when the global pool was started already (by an
        // earlier model): then that pool's size is the process's.
        match rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
        {
            Ok(()) => n,
            Err(_) => rayon::current_num_threads(),
        }
    });
    if set != n {
        return Err(argument(
            py,
            format!(
                "threads={n}: vl's thread pools in this process already run {set} threads \
                 (they are sized once per process, by the first vl.load)"
            ),
        ));
    }
    Ok(())
}

/// A loaded model (see the Python `vl.Model`).
#[pyclass(module = "vl._vl", name = "NativeModel", frozen)]
struct NativeModel {
    captioner: Captioner,
    name: String,
}

fn parse_quantize(py: Python<'_>, q: Option<&str>) -> PyResult<Quantization> {
    let Some(q) = q else {
        return Ok(Quantization::None);
    };
    Quantization::ALL
        .into_iter()
        .find(|f| f.name() == q)
        .ok_or_else(|| {
            argument(
                py,
                format!(
                    "quantize={q:?}: not a format; the formats: {}",
                    Quantization::ALL.map(Quantization::name).join(", ")
                ),
            )
        })
}

/// Loads a model directory, or with the `hub` feature a Hub id
/// (`org/name`, with `revision`).
#[pyfunction]
#[pyo3(signature = (source, *, quantize=None, dtype="f32", text_cache=None, image_cache=None, revision=None))]
fn load(
    py: Python<'_>,
    source: PathBuf,
    quantize: Option<&str>,
    dtype: &str,
    text_cache: Option<&str>,
    image_cache: Option<&str>,
    revision: Option<&str>,
) -> PyResult<NativeModel> {
    let quantization = parse_quantize(py, quantize)?;
    let dtype: DType = vl::settings::parse_dtype(dtype)
        .map_err(|_| argument(py, format!("dtype={dtype:?}: not one of f32, f16, bf16")))?;
    // A cache format: the dtype, or under f32 bf16, f16 or q8 (q8 rows,
    // kept as u8).
    let cache = |arg: &str, name: Option<&str>| -> PyResult<Option<DType>> {
        let Some(name) = name else {
            return Ok(None);
        };
        match vl::settings::parse_cache_format(name) {
            Ok(d) if vl::vl_decoder::VisionLanguageDecoder::cache_fits(dtype, d) => Ok(Some(d)),
            _ => Err(argument(
                py,
                format!(
                    "{arg}={name:?}: the dtype ({}) or, under f32, bf16, f16 or q8",
                    dtype.as_str()
                ),
            )),
        }
    };
    let text_cache = cache("text_cache", text_cache)?;
    let image_cache = cache("image_cache", image_cache)?;
    let dir = resolve(py, &source, revision)?;
    let options = LoadOptions::new(dtype, &Device::Cpu)
        .quantized(quantization)
        .with_text_cache(text_cache)
        .with_image_cache(image_cache);
    let loaded = py.detach(|| vl::load(Source::Dir(&dir), &options));
    let model = loaded.map_err(|e| {
        let message = match quantization {
            Quantization::None => format!("cannot load {}: {e}", dir.display()),
            q => format!(
                "cannot load {} with quantize={:?}: {e}",
                dir.display(),
                q.name()
            ),
        };
        exception(py, Kind::of(&e), message)
    })?;
    Ok(NativeModel {
        captioner: Captioner::new(model),
        name: source.display().to_string(),
    })
}

/// The directory `source` names: itself when it is one, else a Hub id
/// fetched into the Hugging Face cache.
fn resolve(py: Python<'_>, source: &std::path::Path, revision: Option<&str>) -> PyResult<PathBuf> {
    if source.is_dir() {
        if let Some(rev) = revision {
            return Err(argument(
                py,
                format!(
                    "revision={rev:?}: a revision of a Hub repository, but {} is a local directory",
                    source.display()
                ),
            ));
        }
        return Ok(source.to_path_buf());
    }
    let text = source.display().to_string();
    let looks_like_id = !source.is_absolute()
        && !text.starts_with('.')
        && text.matches('/').count() == 1
        && !source.exists();
    if !looks_like_id {
        return Err(exception(
            py,
            Kind::Model,
            format!("{text}: no such model directory"),
        ));
    }
    fetch(py, &text, revision)
}

#[cfg(feature = "hub")]
fn fetch(py: Python<'_>, id: &str, revision: Option<&str>) -> PyResult<PathBuf> {
    py.detach(|| vl::hub::fetch(id, revision))
        .map_err(|e| exception(py, Kind::Model, format!("{e:#}")))
}

#[cfg(not(feature = "hub"))]
fn fetch(py: Python<'_>, id: &str, _revision: Option<&str>) -> PyResult<PathBuf> {
    Err(exception(
        py,
        Kind::Model,
        format!(
            "{id}: no such model directory, and this build has no Hub support \
             (build the wheel with the `hub` feature, as pyproject.toml does)"
        ),
    ))
}

/// One Python input, as vl reads it: a path, encoded bytes (kept
/// alive by the Python object), a decoded PIL image, or an array's pixels.
enum Input<'py> {
    Path(PathBuf),
    Encoded(Bound<'py, PyAny>),
    Decoded(image::DynamicImage),
    Array(PyReadonlyArray3<'py, u8>),
}

/// Reads `item` (input `i`), refusing a type or an array vl cannot take.
fn input<'py>(py: Python<'py>, i: usize, item: &Bound<'py, PyAny>) -> PyResult<Input<'py>> {
    let type_err = |message: String| exception(py, Kind::InputType, message);
    if item.is_instance_of::<PyString>() {
        return Ok(Input::Path(item.extract()?));
    }
    if item.is_instance_of::<PyBytes>() || item.is_instance_of::<PyByteArray>() {
        return Ok(Input::Encoded(item.clone()));
    }
    let os = py.import("os")?;
    if item.is_instance(&os.getattr("PathLike")?)? {
        return Ok(Input::Path(item.extract()?));
    }
    let class = item.get_type();
    let module: String = class.getattr("__module__")?.extract()?;
    let type_name: String = class.getattr("__qualname__")?.extract()?;
    if module.starts_with("numpy") {
        let Ok(array) = item.cast::<PyUntypedArray>() else {
            return Err(type_err(format!(
                "images[{i}]: a numpy.{type_name}, not an array; give a uint8 array of shape (H, W, 3)"
            )));
        };
        let dtype = array.dtype();
        let shape = array.shape().to_vec();
        let is_u8 = dtype.is_equiv_to(&numpy::dtype::<u8>(py));
        if !is_u8 || shape.len() != 3 || shape[2] != 3 {
            return Err(type_err(format!(
                "images[{i}]: expected a uint8 array of shape (H, W, 3), got {} of shape {:?}",
                dtype.str()?,
                shape
            )));
        }
        if shape[0] == 0 || shape[1] == 0 {
            return Err(type_err(format!(
                "images[{i}]: an array of shape {shape:?} has no pixels"
            )));
        }
        return Ok(Input::Array(item.extract()?));
    }
    if module.starts_with("PIL.") && item.hasattr("convert")? && item.hasattr("tobytes")? {
        let rgb = item.call_method1("convert", ("RGB",))?;
        let (width, height): (u32, u32) = rgb.getattr("size")?.extract()?;
        let bytes = rgb.call_method0("tobytes")?;
        let bytes = bytes.cast::<PyBytes>()?.as_bytes().to_vec();
        return match image::RgbImage::from_raw(width, height, bytes) {
            Some(img) => Ok(Input::Decoded(image::DynamicImage::ImageRgb8(img))),
            None => Err(type_err(format!(
                "images[{i}]: a PIL image whose RGB bytes do not fit its size {width}x{height}"
            ))),
        };
    }
    Err(type_err(format!(
        "images[{i}]: a {module}.{type_name}; give a path (str or os.PathLike), encoded bytes, \
         a PIL image or a uint8 NumPy array of shape (H, W, 3)"
    )))
}

/// JSON as Python objects (dicts, lists, str, int, float, bool, None).
fn to_py<'py>(py: Python<'py>, value: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    use serde_json::Value as V;
    Ok(match value {
        V::Null => py.None().into_bound(py),
        V::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        V::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => PyInt::new(py, i).into_any(),
            (None, Some(u), _) => PyInt::new(py, u).into_any(),
            (_, _, f) => PyFloat::new(py, f.unwrap_or(f64::NAN)).into_any(),
        },
        V::String(s) => PyString::new(py, s).into_any(),
        V::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(to_py(py, item)?)?;
            }
            list.into_any()
        }
        V::Object(map) => {
            let dict = PyDict::new(py);
            for (k, v) in map {
                dict.set_item(k, to_py(py, v)?)?;
            }
            dict.into_any()
        }
    })
}

/// Generation settings as the Python keywords name them.
#[derive(Debug, Default, Clone, FromPyObject)]
#[pyo3(from_item_all)]
struct Settings {
    max_tokens: Option<usize>,
    min_tokens: Option<usize>,
    beams: Option<usize>,
    length_penalty: Option<f32>,
    temperature: Option<f64>,
    top_k: Option<usize>,
    top_p: Option<f64>,
    repetition_penalty: Option<f32>,
    no_repeat_ngram_size: Option<usize>,
    seed: Option<u64>,
}

#[pymethods]
impl NativeModel {
    /// Captions `images` (a list); returns one item per image, in order:
    /// a dict as `vl caption --json` writes it, or the exception that
    /// image raised.
    #[pyo3(signature = (images, *, settings, prompt=None, task=None, batch_size=8))]
    fn caption<'py>(
        &self,
        py: Python<'py>,
        images: Vec<Bound<'py, PyAny>>,
        settings: Settings,
        prompt: Option<String>,
        task: Option<String>,
        batch_size: usize,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let Some(batch_size) = NonZeroUsize::new(batch_size) else {
            return Err(argument(py, "batch_size=0: must be at least 1"));
        };
        let model = self.captioner.model();
        let task: Option<Task> = match task {
            None => None,
            Some(t) => Some(t.parse().map_err(|e| vl_err(py, &e))?),
        };
        if task.is_some() && model.text_encoder.is_none() {
            return Err(argument(
                py,
                format!(
                    "task={:?}: the model {} takes no task; only Florence-2 checkpoints do",
                    task.map(Task::name).unwrap_or_default(),
                    self.name
                ),
            ));
        }
        let generation = GenerationOverrides {
            max_tokens: settings.max_tokens,
            min_tokens: settings.min_tokens,
            beams: settings.beams,
            length_penalty: settings.length_penalty,
            temperature: settings.temperature,
            top_k: settings.top_k,
            top_p: settings.top_p,
            repetition_penalty: settings.repetition_penalty,
            no_repeat_ngram_size: settings.no_repeat_ngram_size,
            seed: settings.seed.unwrap_or(0),
        }
        .apply(self.captioner.generation(), &model.config.decoder)
        .map_err(|e| match e {
            OverrideError::Setting {
                setting,
                value,
                reason,
            } => {
                let keyword = setting.flag().trim_start_matches("--").replace('-', "_");
                let value = value.map(|v| format!("={v}")).unwrap_or_default();
                argument(py, format!("{keyword}{value}: {reason}"))
            }
            other => argument(py, other.to_string()),
        })?;
        // Read every input first: a type vl cannot take is the caller's
        // mistake, refused before any work.
        let inputs = images
            .iter()
            .enumerate()
            .map(|(i, item)| input(py, i, item))
            .collect::<PyResult<Vec<_>>>()?;
        // Encoded bytes decoded as vl reads a file (limits included), each
        // its own error; arrays read in place, non-contiguous ones gathered
        // once.
        let mut decoded: Vec<Option<image::DynamicImage>> = Vec::with_capacity(inputs.len());
        let mut early: Vec<Option<vl::Error>> = Vec::with_capacity(inputs.len());
        let mut gathered: Vec<Option<Vec<u8>>> = Vec::with_capacity(inputs.len());
        for (i, item) in inputs.iter().enumerate() {
            let (image, err) = match item {
                Input::Encoded(b) => {
                    let owned;
                    let bytes: &[u8] = match b.cast::<PyBytes>() {
                        Ok(b) => b.as_bytes(),
                        Err(_) => {
                            owned = b.extract::<Vec<u8>>()?;
                            &owned
                        }
                    };
                    let name = PathBuf::from(format!("images[{i}]"));
                    match vl::vl_vision::preprocess::decode_image(bytes, &name) {
                        Ok(img) => (Some(img), None),
                        Err(e) => (None, Some(vl::Error::from(e))),
                    }
                }
                _ => (None, None),
            };
            decoded.push(image);
            early.push(err);
            gathered.push(match item {
                // Fortran-ordered arrays are contiguous too, but not in
                // rows: gathered in row order like any strided one.
                Input::Array(a) if !a.is_c_contiguous() => {
                    Some(a.as_array().iter().copied().collect())
                }
                _ => None,
            });
        }
        let mut slots: Vec<Option<ImageInput<'_>>> = Vec::with_capacity(inputs.len());
        for ((item, dec), owned) in inputs.iter().zip(&decoded).zip(&gathered) {
            slots.push(match item {
                Input::Path(p) => Some(ImageInput::Path(p)),
                Input::Decoded(img) => Some(ImageInput::Image(img)),
                Input::Encoded(_) => dec.as_ref().map(ImageInput::Image),
                Input::Array(a) => {
                    let shape = a.shape();
                    let pixels = match owned {
                        Some(v) => v.as_slice(),
                        // C-contiguous (checked above): rows in place.
                        None => a.as_slice().unwrap_or_default(),
                    };
                    Some(ImageInput::Rgb8 {
                        width: shape[1] as u32,
                        height: shape[0] as u32,
                        pixels,
                    })
                }
            });
        }
        let runnable: Vec<ImageInput<'_>> = slots.iter().flatten().copied().collect();
        let request = Request {
            generation,
            prompt: prompt.as_deref(),
            task,
        };
        let captioner = &self.captioner;
        let done = py.detach(|| captioner.caption_batched(&runnable, &request, batch_size));
        let mut done = done.map_err(|e| vl_err(py, &e))?.into_iter();
        let mut results = Vec::with_capacity(inputs.len());
        for (slot, err) in slots.iter().zip(early) {
            let outcome = match (slot, err) {
                (_, Some(e)) => Err(e),
                (Some(_), None) => done.next().unwrap_or_else(|| {
                    Err(vl::Error::Argument {
                        arg: "image",
                        reason: "was not captioned".into(),
                    })
                }),
                (None, None) => Err(vl::Error::Argument {
                    arg: "image",
                    reason: "was not read".into(),
                }),
            };
            results.push(match outcome {
                Ok(c) => to_py(py, &c.to_json(task))?,
                Err(e) => vl_err(py, &e).into_value(py).into_bound(py).into_any(),
            });
        }
        Ok(results)
    }

    /// The directory or Hub id the model was loaded from.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// The directory the model's files are in.
    #[getter]
    fn path(&self) -> PathBuf {
        self.captioner.model().path.clone()
    }

    /// The checkpoint's family: `vl`, `vision-encoder-decoder`, `blip`
    /// or `florence2`.
    #[getter]
    fn family(&self) -> &'static str {
        use vl::ModelFormat as F;
        match self.captioner.model().format {
            F::Vl => "vl",
            F::VisionEncoderDecoder => "vision-encoder-decoder",
            F::Blip => "blip",
            F::Florence2 => "florence2",
        }
    }

    /// The tasks the model takes (Florence-2's), by vl's names.
    #[getter]
    fn tasks(&self) -> Vec<&'static str> {
        match self.captioner.model().text_encoder {
            Some(_) => Task::ALL.map(Task::name).to_vec(),
            None => Vec::new(),
        }
    }

    /// The format of its linear layers (`none`, `bf16`, `q8_0`, …).
    #[getter]
    fn quantization(&self) -> &'static str {
        self.captioner.model().quantization.name()
    }

    /// The checkpoint's default generation settings.
    #[getter]
    fn generation<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let g = self.captioner.generation();
        let d = PyDict::new(py);
        d.set_item("max_tokens", g.max_new_tokens)?;
        d.set_item("min_tokens", g.min_new_tokens)?;
        d.set_item("strategy", format!("{:?}", g.strategy))?;
        Ok(d)
    }
}

/// Has glibc's allocator keep freed memory for reuse, as the `vl` command
/// does at its start ([`vl::keep_freed_memory`]): a batch's activations
/// are allocated and freed layer after layer. The package calls it when
/// imported, before vl's threads start.
#[pyfunction]
fn keep_freed_memory() {
    vl::keep_freed_memory();
}

/// Hands the allocator's free memory back to the kernel
/// ([`vl::return_freed_memory`]): what a model's load freed.
#[pyfunction]
fn return_freed_memory() {
    vl::return_freed_memory();
}

/// The native module.
#[pymodule]
fn _vl(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(load, m)?)?;
    m.add_function(wrap_pyfunction!(set_threads, m)?)?;
    m.add_function(wrap_pyfunction!(keep_freed_memory, m)?)?;
    m.add_function(wrap_pyfunction!(return_freed_memory, m)?)?;
    m.add_class::<NativeModel>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
