//! `vl serve`: the model behind an OpenAI-compatible HTTP API on tokio +
//! axum, one worker thread owning the model ([`worker`]).
//!
//! - `POST /v1/chat/completions`: one `image_url` part (a `data:` URL; the
//!   server fetches nothing) and text parts (BLIP's prompt; Florence-2's
//!   task token or free prompt; ignored by models that take no prompt),
//!   `max_tokens`, `temperature`, `top_p`, `seed`, `stream`, and vl's
//!   `num_beams` and `task`; absent fields take the checkpoint's
//!   generation defaults. Answers and stream chunks are OpenAI's shapes.
//! - `POST /v1/caption`: a multipart upload of images (one file part
//!   each) → one JSON line per image, as `vl caption --json` prints them.
//! - `GET /v1/models`, `GET /health` (503 until the model is loaded and
//!   warmed up), `GET /metrics` (Prometheus text).
//!
//! Bad input gets a 4xx with OpenAI's error object naming the field; the
//! queue is bounded (429 with `Retry-After` when full); SIGTERM or Ctrl-C
//! stops accepting, lets in-flight requests finish within
//! `--drain-timeout`, and exits 0.

pub mod api;
pub mod worker;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use candle_core::{DType, Device, Tensor};
use tokio::sync::mpsc;
use vl::captioner::Captioner;
use vl::tasks::Task;
use vl::vl_decoder::{GenerationConfig, Strategy};
use vl::vl_vision::PixelSpec;

use crate::args::ModelArgs;
use api::{image_data, parse_request, ApiError, ChatRequest, Content, ImageData, Part, Usage};
use worker::{Event, Finished, Job, Metrics};

/// Serve a model over HTTP (OpenAI's chat completions).
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Fetch the model ORG/NAME from the Hugging Face Hub instead (needs the `hub` feature).
    #[arg(long, conflicts_with = "model")]
    model_id: Option<String>,
    /// With --model-id: the branch, tag or commit to fetch [default: main].
    #[arg(long, requires = "model_id")]
    revision: Option<String>,
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    /// The port (0: any free one; the address is printed on stdout).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Requests waiting for the model before new ones get 429.
    #[arg(long, default_value = "64", value_parser = crate::args::positive)]
    max_queue: std::num::NonZeroUsize,
    /// Requests decoded together at most.
    #[arg(long, default_value = "16", value_parser = crate::args::positive)]
    max_batch: std::num::NonZeroUsize,
    /// Also take `file://` image URLs naming files under DIR (links
    /// resolved first; nothing outside it is read). Off by default: a
    /// request can then only send its image's bytes.
    #[arg(long, value_name = "DIR")]
    allow_local_files: Option<std::path::PathBuf>,
    /// Distinct images admitted between two decode steps at most (a
    /// request's `n` choices share one): they are encoded together while
    /// the running requests wait (a CPU encodes a large batch no faster per
    /// image than a small one).
    #[arg(long, default_value = "1", value_parser = crate::args::positive)]
    encode_batch: std::num::NonZeroUsize,
    /// Largest request body, in MiB.
    #[arg(long, default_value_t = 20)]
    max_body_mib: usize,
    /// Seconds a request may take, queueing included, before a 504.
    #[arg(long, default_value_t = 120)]
    request_timeout: u64,
    /// Seconds in-flight requests get to finish after SIGTERM.
    #[arg(long, default_value_t = 30)]
    drain_timeout: u64,
}

/// What the handlers need once the model is up.
struct Ready {
    jobs: mpsc::Sender<Job>,
    spec: PixelSpec,
    id: String,
    generation: GenerationConfig,
    max_positions: usize,
    image_tokens: usize,
    takes_tasks: bool,
    takes_prompt: bool,
    tokenizer: tokenizers::Tokenizer,
    /// The block whose cross-attention `attention_map` returns, when the
    /// model has a patch grid to show it on.
    heatmap_layer: Option<usize>,
}

struct AppState {
    ready: OnceLock<Ready>,
    /// `--allow-local-files`, resolved.
    allow_local: Option<std::path::PathBuf>,
    /// `--max-body-mib`, in bytes.
    max_body: usize,
    metrics: Arc<Metrics>,
    timeout: Duration,
    created: u64,
}

type Shared = Arc<AppState>;

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn not_ready() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "model_loading",
        None,
        "the model is still loading",
    )
}

async fn health(State(s): State<Shared>) -> Response {
    match s.ready.get() {
        Some(_) => (StatusCode::OK, Json(serde_json::json!({"status": "ok"}))).into_response(),
        None => not_ready().into_response(),
    }
}

async fn models(State(s): State<Shared>) -> Response {
    match s.ready.get() {
        Some(r) => Json(serde_json::json!({"object": "list", "data": [
            {"id": r.id, "object": "model", "created": s.created, "owned_by": "vl",
             "vl": {"tasks": r.takes_tasks, "attention_map": r.heatmap_layer.is_some()}}
        ]}))
        .into_response(),
        None => not_ready().into_response(),
    }
}

async fn metrics(State(s): State<Shared>) -> String {
    s.metrics.render()
}

/// The request in vl's terms, checked: an error names the field.
struct Checked {
    /// Choices asked for (OpenAI's `n`).
    n: usize,
    image: ImageData,
    image_param: String,
    generation: GenerationConfig,
    prompt: Option<String>,
    task: Option<Task>,
    stream: bool,
}

/// The most choices (`n`) one request may ask for.
const MAX_CHOICES: usize = 16;

fn check(
    req: ChatRequest,
    r: &Ready,
    local: Option<&std::path::Path>,
) -> Result<Checked, ApiError> {
    if let Some(m) = &req.model {
        if m != &r.id {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "model_not_found",
                Some("model"),
                format!(
                    "the model {m:?} is not served here; this server serves {:?}",
                    r.id
                ),
            ));
        }
    }
    let n = req.n.unwrap_or(1);
    if !(1..=MAX_CHOICES).contains(&n) {
        return Err(ApiError::invalid(
            "n",
            format!("{n} is not in 1..={MAX_CHOICES}"),
        ));
    }
    let mut image = None;
    let mut texts = Vec::new();
    for (i, m) in req.messages.iter().enumerate() {
        if !matches!(
            m.role.as_str(),
            "system" | "user" | "assistant" | "developer"
        ) {
            return Err(ApiError::invalid(
                format!("messages[{i}].role"),
                format!("unknown role {:?}", m.role),
            ));
        }
        match &m.content {
            Content::Text(t) if m.role == "user" => texts.push(t.clone()),
            Content::Text(_) => {}
            Content::Parts(parts) => {
                for (j, p) in parts.iter().enumerate() {
                    match p {
                        Part::Text { text } if m.role == "user" => texts.push(text.clone()),
                        Part::Text { .. } => {}
                        Part::ImageUrl { image_url } => {
                            let param = format!("messages[{i}].content[{j}].image_url.url");
                            if image.is_some() {
                                return Err(ApiError::invalid(
                                    param,
                                    "one image per request: this one is the second",
                                ));
                            }
                            image = Some((image_data(&image_url.url, &param, local)?, param));
                        }
                    }
                }
            }
        }
    }
    let Some((image, image_param)) = image else {
        return Err(ApiError::invalid(
            "messages",
            "no image: add a content part {\"type\": \"image_url\", \"image_url\": {\"url\": \"data:image/png;base64,…\"}}",
        ));
    };
    let text = texts.join("\n").trim().to_string();
    let mut task = match &req.task {
        Some(t) => Some(
            t.parse::<Task>()
                .map_err(|e| ApiError::invalid("task", e.to_string()))?,
        ),
        None => None,
    };
    if task.is_some() && !r.takes_tasks {
        return Err(ApiError::invalid(
            "task",
            "the served model takes no task; only Florence-2 does",
        ));
    }
    let mut prompt = (!text.is_empty()).then_some(text);
    if r.takes_tasks && task.is_none() {
        // A message that is a task token is the task.
        if let Some(t) = prompt.as_deref().and_then(|p| p.parse::<Task>().ok()) {
            task = Some(t);
            prompt = None;
        }
    }
    if let Some(t) = task {
        t.prompt(prompt.as_deref())
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    }
    if !r.takes_prompt && !r.takes_tasks {
        // A captioner without prompts captions the image whatever the text.
        prompt = None;
    }
    let mut generation = r.generation.clone();
    let max_tokens = req.max_completion_tokens.or(req.max_tokens);
    if let Some(n) = max_tokens {
        let limit = r.max_positions.saturating_sub(1);
        if n == 0 || n > limit {
            return Err(ApiError::invalid(
                if req.max_completion_tokens.is_some() {
                    "max_completion_tokens"
                } else {
                    "max_tokens"
                },
                format!("{n} is not in 1..={limit} (the model's positions)"),
            ));
        }
        generation.max_new_tokens = n;
        generation.min_new_tokens = generation.min_new_tokens.min(n);
    }
    if let Some(m) = req.min_tokens {
        if m > generation.max_new_tokens {
            return Err(ApiError::invalid(
                "min_tokens",
                format!(
                    "{m} is more than the {} tokens that may be generated (max_tokens)",
                    generation.max_new_tokens
                ),
            ));
        }
        generation.min_new_tokens = m;
    }
    if let Some(t) = req.temperature {
        if !(0.0..=2.0).contains(&t) {
            return Err(ApiError::invalid(
                "temperature",
                format!("{t} is not in [0, 2]"),
            ));
        }
    }
    if let Some(p) = req.top_p {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ApiError::invalid("top_p", format!("{p} is not in (0, 1]")));
        }
    }
    match (req.num_beams, req.temperature) {
        (Some(0), _) => return Err(ApiError::invalid("num_beams", "must be at least 1")),
        (Some(b), Some(t)) if b > 1 && t > 0.0 => {
            return Err(ApiError::invalid(
                "num_beams",
                "beam search does not sample: leave temperature out or 0",
            ))
        }
        (Some(b), _) if b > 1 => generation.strategy = Strategy::beam(b),
        (Some(_), _) => generation.strategy = Strategy::Greedy,
        (None, Some(t)) if t > 0.0 => {
            generation.strategy = Strategy::Sample {
                temperature: t,
                top_k: None,
                top_p: req.top_p,
                seed: req.seed.unwrap_or(0),
            }
        }
        (None, Some(_)) => generation.strategy = Strategy::Greedy,
        (None, None) => {}
    }
    if req.attention_map == Some(true) {
        match r.heatmap_layer {
            Some(layer) => generation.cross_attention_of = Some(layer),
            None => {
                return Err(ApiError::invalid(
                    "attention_map",
                    "the served model has no patch grid to show its attention on",
                ))
            }
        }
    }
    Ok(Checked {
        n,
        image,
        image_param,
        generation,
        prompt,
        task,
        stream: req.stream.unwrap_or(false),
    })
}

/// The model to load: `--model-id` fetched from the Hub (before the server
/// starts, so that a failed download is the command's error), else
/// `--model` or the embedded captioner.
fn model_args(args: &Args) -> anyhow::Result<ModelArgs> {
    match &args.model_id {
        None => Ok(args.model.clone()),
        #[cfg(feature = "hub")]
        Some(id) => {
            let dir = vl::hub::fetch(id, args.revision.as_deref())?;
            Ok(ModelArgs {
                model: Some(dir),
                ..args.model.clone()
            })
        }
        #[cfg(not(feature = "hub"))]
        Some(id) => anyhow::bail!(
            "--model-id {id}: this build has no Hub support; rebuild with `--features hub`, \
             or download the checkpoint and pass --model DIR"
        ),
    }
}

/// The model's id in `/v1/models` and requests: the directory's name, or
/// the embedded captioner's.
fn served_id(args: &ModelArgs) -> String {
    match args.model.as_deref().and_then(|d| d.file_name()) {
        Some(name) => name.to_string_lossy().into_owned(),
        None => {
            let name = args.name();
            name.strip_prefix("embedded:").unwrap_or(&name).to_string()
        }
    }
}

fn completion_id() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    format!("chatcmpl-vl-{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// The body, refused with 413 from its `Content-Length` before any of it
/// is read when it announces more than `--max-body-mib` (and when it
/// grows past it without one).
async fn read_body(
    s: &AppState,
    headers: &axum::http::HeaderMap,
    body: axum::body::Body,
) -> Result<Bytes, ApiError> {
    let too_large = |n: Option<usize>| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            Some("body"),
            format!(
                "the body{} is over the server's limit of {} bytes (--max-body-mib)",
                n.map(|n| format!(" ({n} bytes)")).unwrap_or_default(),
                s.max_body
            ),
        )
    };
    let announced = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if let Some(n) = announced.filter(|&n| n > s.max_body) {
        return Err(too_large(Some(n)));
    }
    axum::body::to_bytes(body, s.max_body)
        .await
        .map_err(|_| too_large(None))
}

async fn chat(
    State(s): State<Shared>,
    headers: axum::http::HeaderMap,
    body: axum::body::Body,
) -> Response {
    let response = match read_body(&s, &headers, body).await {
        Ok(body) => chat_inner(&s, body).await,
        Err(e) => Err(e),
    };
    let response = match response {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    s.metrics.answered(response.status().as_u16());
    response
}

async fn chat_inner(s: &Shared, body: Bytes) -> Result<Response, ApiError> {
    let Some(r) = s.ready.get() else {
        return Err(not_ready());
    };
    let checked = check(parse_request(&body)?, r, s.allow_local.as_deref())?;
    // Decode and preprocess off the async threads; a bad image is this
    // request's 400 before it queues.
    let bytes = match checked.image {
        ImageData::Bytes(b) => b,
        ImageData::File(path) => read_local(path, s.max_body, &checked.image_param).await?,
    };
    let (pixels, size) = prepare(r.spec, bytes, checked.image_param.clone()).await?;

    let prompt_tokens = r.image_tokens
        + checked
            .prompt
            .as_deref()
            .and_then(|p| r.tokenizer.encode(p, false).ok())
            .map_or(0, |e| e.len());
    // One job per choice, all over the same pixels; sampled choices draw
    // from seeds `seed`, `seed + 1`, … (greedy and beam choices are equal).
    let mut receivers = Vec::with_capacity(checked.n);
    for i in 0..checked.n {
        let mut generation = checked.generation.clone();
        if let Strategy::Sample { seed, .. } = &mut generation.strategy {
            *seed = seed.wrapping_add(i as u64);
        }
        let (tx, rx) = mpsc::unbounded_channel();
        enqueue(
            s,
            r,
            Job {
                pixels: pixels.clone(),
                size,
                generation,
                prompt: checked.prompt.clone(),
                task: checked.task,
                events: tx,
                queued: Instant::now(),
            },
        )?;
        receivers.push(rx);
    }
    let id = completion_id();
    let created = now_secs();
    let model = r.id.clone();
    let deadline = tokio::time::Instant::now() + s.timeout;
    if checked.stream {
        let chunk = move |index: usize, delta: serde_json::Value, finish: Option<&str>| {
            serde_json::json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "finish_reason": finish}],
            })
        };
        let sse = |v: serde_json::Value| {
            Ok::<_, std::convert::Infallible>(SseEvent::default().data(v.to_string()))
        };
        let firsts: Vec<_> = (0..checked.n)
            .map(|i| {
                sse(chunk(
                    i,
                    serde_json::json!({"role": "assistant", "content": ""}),
                    None,
                ))
            })
            .collect();
        use futures_util::StreamExt;
        // Each choice's events, tagged with its index, until its end or
        // the deadline; merged as they come.
        let per_choice = receivers.into_iter().enumerate().map(|(index, rx)| {
            futures_util::stream::unfold((rx, false), move |(mut rx, done)| async move {
                if done {
                    return None;
                }
                match tokio::time::timeout_at(deadline, rx.recv()).await {
                    Ok(Some(e)) => {
                        let end = matches!(e, Event::Done(_));
                        Some(((index, e), (rx, end)))
                    }
                    Ok(None) | Err(_) => None,
                }
            })
            .boxed()
        });
        let events = futures_util::stream::select_all(per_choice).map(move |(index, e)| match e {
            Event::Delta(d) => sse(chunk(index, serde_json::json!({"content": d}), None)),
            Event::Done(Ok(f)) => {
                let reason = if f.stopped { "stop" } else { "length" };
                let mut c = chunk(index, serde_json::json!({}), Some(reason));
                if let Some(a) = attention_json(&f) {
                    c["vl_attention"] = a;
                }
                sse(c)
            }
            Event::Done(Err(e)) => sse(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "generation_failed",
                None,
                e,
            )
            .body()),
        });
        let done = futures_util::stream::once(async {
            Ok::<_, std::convert::Infallible>(SseEvent::default().data("[DONE]"))
        });
        return Ok(
            Sse::new(futures_util::stream::iter(firsts).chain(events).chain(done)).into_response(),
        );
    }
    let mut choices = Vec::with_capacity(checked.n);
    let mut completion_tokens = 0;
    for (index, mut rx) in receivers.into_iter().enumerate() {
        let finished = match tokio::time::timeout_at(deadline, outcome_of(&mut rx)).await {
            Err(_) => {
                return Err(ApiError::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "timeout",
                    None,
                    format!(
                        "not answered within --request-timeout {} s",
                        s.timeout.as_secs()
                    ),
                ))
            }
            Ok(None) => {
                return Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "shutting_down",
                    None,
                    "the model worker stopped",
                ))
            }
            Ok(Some(Err(e))) => {
                return Err(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "generation_failed",
                    None,
                    e,
                ))
            }
            Ok(Some(Ok(f))) => f,
        };
        completion_tokens += finished.tokens;
        let mut message = serde_json::json!({"role": "assistant", "content": finished.text});
        if let Some(a) = attention_json(&finished) {
            message["vl_attention"] = a;
        }
        if let (Some(t), Some(v)) = (checked.task, &finished.task) {
            // A task's parsed output under the processor's key, as --json.
            message["vl_task"] = serde_json::json!({ t.token(): v });
        }
        choices.push(serde_json::json!({
            "index": index, "message": message,
            "finish_reason": if finished.stopped { "stop" } else { "length" },
        }));
    }
    let usage = Usage {
        prompt_tokens,
        completion_tokens,
        total_tokens: prompt_tokens + completion_tokens,
    };
    Ok(Json(serde_json::json!({
        "id": id, "object": "chat.completion", "created": created, "model": model,
        "choices": choices,
        "usage": usage,
    }))
    .into_response())
}

/// A `--allow-local-files` image, read off the async threads; one past
/// `--max-body-mib` or unreadable is `param`'s 400.
async fn read_local(
    path: std::path::PathBuf,
    max: usize,
    param: &str,
) -> Result<Vec<u8>, ApiError> {
    let len = tokio::fs::metadata(&path)
        .await
        .map_err(|e| ApiError::invalid(param, format!("cannot read {}: {e}", path.display())))?
        .len();
    if len > max as u64 {
        return Err(ApiError::invalid(
            param,
            format!(
                "{} is {len} bytes, more than --max-body-mib allows ({max})",
                path.display()
            ),
        ));
    }
    tokio::fs::read(&path)
        .await
        .map_err(|e| ApiError::invalid(param, format!("cannot read {}: {e}", path.display())))
}

/// Decodes and preprocesses an image off the async threads; a bad image
/// is `param`'s 400.
async fn prepare(
    spec: PixelSpec,
    bytes: Vec<u8>,
    param: String,
) -> Result<(Tensor, (u32, u32)), ApiError> {
    tokio::task::spawn_blocking(move || {
        let img = vl::vl_vision::preprocess::decode_image(&bytes, std::path::Path::new("image"))
            .map_err(|e| ApiError::invalid(param.clone(), e.to_string()))?;
        let size = (img.width(), img.height());
        let pixels = vl::vl_vision::preprocess::preprocess(&img, &spec, &Device::Cpu)
            .map_err(|e| ApiError::invalid(param, e.to_string()))?;
        Ok((pixels, size))
    })
    .await
    .map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            None,
            e.to_string(),
        )
    })?
}

/// `attention_map`'s payload: the patch grid's side and, per token, its
/// text and weights (row-major over the grid), or `None` without weights.
fn attention_json(f: &Finished) -> Option<serde_json::Value> {
    let patches = f.attention.first()?.1.len();
    let grid = (patches as f64).sqrt().round() as usize;
    Some(serde_json::json!({
        "grid": grid,
        "tokens": f.attention.iter().map(|(text, w)| serde_json::json!({"text": text, "weights": w}))
            .collect::<Vec<_>>(),
    }))
}

/// The page at `/`: pick or drop an image, watch the caption stream in,
/// hover a word to see where the model looked (embedded, no CDN).
async fn page() -> axum::response::Html<&'static str> {
    axum::response::Html(include_str!("page.html"))
}

/// A request's outcome, its streamed text skipped; `None` when the worker
/// stopped without one.
async fn outcome_of(rx: &mut mpsc::UnboundedReceiver<Event>) -> Option<Result<Finished, String>> {
    loop {
        match rx.recv().await {
            Some(Event::Delta(_)) => {}
            Some(Event::Done(d)) => return Some(d),
            None => return None,
        }
    }
}

/// Queues one job; `Err` when the queue is full or closed.
fn enqueue(s: &AppState, r: &Ready, job: Job) -> Result<(), ApiError> {
    s.metrics.queued.fetch_add(1, Ordering::Relaxed);
    r.jobs.try_send(job).map_err(|e| {
        s.metrics.queued.fetch_sub(1, Ordering::Relaxed);
        match e {
            mpsc::error::TrySendError::Full(_) => ApiError {
                retry_after: Some(1),
                ..ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "queue_full",
                    None,
                    "the request queue is full; retry later",
                )
            },
            mpsc::error::TrySendError::Closed(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting_down",
                None,
                "the server is shutting down",
            ),
        }
    })
}

/// `POST /v1/caption`: every file part of a multipart body captioned with
/// the model's defaults; one JSON line per image in upload order,
/// `{"image", "caption", "token_ids"}` or `{"image", "error"}` — a bad
/// image costs only its own line.
async fn caption_upload(State(s): State<Shared>, mut form: axum::extract::Multipart) -> Response {
    let response = match caption_upload_inner(&s, &mut form).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    s.metrics.answered(response.status().as_u16());
    response
}

async fn caption_upload_inner(
    s: &Shared,
    form: &mut axum::extract::Multipart,
) -> Result<Response, ApiError> {
    let Some(r) = s.ready.get() else {
        return Err(not_ready());
    };
    let mut pending = Vec::new();
    let mut index = 0;
    loop {
        let field = form.next_field().await.map_err(|e| {
            ApiError::new(e.status(), "invalid_multipart", Some("body"), e.body_text())
        })?;
        let Some(field) = field else { break };
        let name = field
            .file_name()
            .map(String::from)
            .unwrap_or_else(|| format!("image-{index}"));
        index += 1;
        let bytes = field.bytes().await.map_err(|e| {
            ApiError::new(e.status(), "invalid_multipart", Some("body"), e.body_text())
        })?;
        let outcome = match prepare(r.spec, bytes.to_vec(), name.clone()).await {
            Err(e) => Err(e.message),
            Ok((pixels, size)) => {
                let (tx, rx) = mpsc::unbounded_channel();
                enqueue(
                    s,
                    r,
                    Job {
                        pixels,
                        size,
                        generation: r.generation.clone(),
                        prompt: None,
                        task: None,
                        events: tx,
                        queued: Instant::now(),
                    },
                )?;
                Ok(rx)
            }
        };
        pending.push((name, outcome));
    }
    if pending.is_empty() {
        return Err(ApiError::invalid(
            "body",
            "no file part: upload images as multipart files",
        ));
    }
    let mut lines = String::new();
    for (name, outcome) in pending {
        let line = match outcome {
            Err(e) => serde_json::json!({"image": name, "error": e}),
            Ok(mut rx) => {
                let done = tokio::time::timeout(s.timeout, outcome_of(&mut rx)).await;
                match done {
                    Ok(Some(Ok(f))) => {
                        serde_json::json!({"image": name, "caption": f.text, "token_ids": f.token_ids})
                    }
                    Ok(Some(Err(e))) => serde_json::json!({"image": name, "error": e}),
                    Ok(None) => {
                        serde_json::json!({"image": name, "error": "the model worker stopped"})
                    }
                    Err(_) => serde_json::json!({"image": name, "error": "timed out"}),
                }
            }
        };
        lines.push_str(&line.to_string());
        lines.push('\n');
    }
    Ok(([("content-type", "application/x-ndjson")], lines).into_response())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    tracing::info!("shutting down: no new connections, draining the ones in flight");
}

/// Runs `vl serve` until SIGTERM or Ctrl-C.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(serve(args))
}

async fn serve(args: &Args) -> anyhow::Result<()> {
    let allow_local = args
        .allow_local_files
        .as_ref()
        .map(|d| {
            d.canonicalize()
                .ok()
                .filter(|d| d.is_dir())
                .with_context(|| format!("--allow-local-files {}: not a folder", d.display()))
        })
        .transpose()?;
    let state = Arc::new(AppState {
        ready: OnceLock::new(),
        allow_local,
        max_body: args.max_body_mib * 1024 * 1024,
        metrics: Arc::new(Metrics::default()),
        timeout: Duration::from_secs(args.request_timeout),
        created: now_secs(),
    });
    let app = Router::new()
        .route("/", get(page))
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/caption", post(caption_upload))
        .layer(DefaultBodyLimit::max(args.max_body_mib * 1024 * 1024))
        .with_state(state.clone());
    let model_args = tokio::task::block_in_place(|| model_args(args))?;
    let addr = SocketAddr::new(args.host, args.port);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("--host {} --port {}: cannot listen", args.host, args.port))?;
    let local = listener.local_addr()?;
    println!("listening on http://{local}");
    use std::io::Write;
    let _ = std::io::stdout().flush();

    // The model loads while the server already answers /health (503); a
    // model that cannot load ends the server with its error.
    let (jobs, rx) = mpsc::channel(args.max_queue.get());
    let metrics = state.metrics.clone();
    let limits = worker::Limits {
        max_batch: args.max_batch.get(),
        encode_batch: args.encode_batch.get(),
    };
    let loader_state = state.clone();
    let (failed_tx, failed_rx) = tokio::sync::oneshot::channel::<anyhow::Error>();
    std::thread::Builder::new()
        .name("vl-model".into())
        .spawn(move || {
            let loaded = (|| -> anyhow::Result<Captioner> {
                let model = model_args.load()?;
                let captioner = Captioner::new(model);
                // A warm-up encode, which also counts the image tokens.
                let m = captioner.model();
                let (h, w) = m.pixel_spec()?.size();
                let blank = Tensor::zeros((1, 3, h, w), DType::F32, &Device::Cpu)?;
                let image_tokens = m.encode_pixels(&blank)?.dim(1)?;
                let ready = Ready {
                    jobs,
                    spec: *m.pixel_spec()?,
                    id: served_id(&model_args),
                    generation: captioner.generation().clone(),
                    max_positions: m.decoder.config().max_position_embeddings,
                    image_tokens,
                    takes_tasks: m.text_encoder.is_some(),
                    takes_prompt: m.format == vl::ModelFormat::Blip,
                    tokenizer: m.tokenizer.clone(),
                    heatmap_layer: captioner
                        .with_heatmaps(captioner.generation())
                        .ok()
                        .and_then(|g| g.cross_attention_of),
                };
                if loader_state.ready.set(ready).is_err() {
                    anyhow::bail!("the model was made ready twice");
                }
                Ok(captioner)
            })();
            drop(loader_state);
            match loaded {
                Ok(captioner) => {
                    tracing::info!("model loaded: {}", model_args.name());
                    worker::run(captioner, rx, limits, metrics);
                }
                Err(e) => {
                    let _ = failed_tx.send(e);
                }
            }
        })
        .context("cannot start the model thread")?;

    // SIGTERM or Ctrl-C: stop accepting; in-flight requests get `drain`.
    let drain = Duration::from_secs(args.drain_timeout);
    let (signal_tx, signal_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = signal_tx.send(true);
    });
    let mut on_signal = signal_rx.clone();
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        let _ = on_signal.wait_for(|stop| *stop).await;
    });
    let mut served = tokio::spawn(async move { server.await });
    let mut drained = signal_rx.clone();
    tokio::select! {
        r = &mut served => r.context("the server task failed")?.context("serving")?,
        Ok(e) = failed_rx => return Err(e),
        () = async {
            let _ = drained.wait_for(|stop| *stop).await;
            tokio::time::sleep(drain).await;
        } => {
            tracing::warn!("drain timeout ({} s) passed with requests in flight", drain.as_secs());
            served.abort();
        }
    }
    // The router and its job senders are gone: the worker finishes its
    // batch and stops with the process.
    drop(state);
    Ok(())
}
