//! The one thread that owns the model: it takes the queued requests,
//! captions those that can share a batch together (the same settings,
//! greedy or beams; a sampled request alone, so that its draws do not
//! depend on its neighbours), and streams each request's text as its
//! tokens are chosen.
//!
//! Batches form between batches: requests that arrive while one decodes
//! wait for the next (requests do not join a running batch).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::Tensor;
use tokio::sync::mpsc;
use vl::captioner::{Captioner, Request};
use vl::tasks::Task;
use vl::vl_decoder::{GenerationConfig, Strategy};

/// One request for the worker.
pub struct Job {
    /// The image as the encoder takes it, `(3, size, size)`.
    pub pixels: Tensor,
    /// The original image's (width, height): a task's locations are in it.
    pub size: (u32, u32),
    /// Decoding settings.
    pub generation: GenerationConfig,
    /// BLIP's prompt, or Florence-2's task input / free prompt.
    pub prompt: Option<String>,
    /// Florence-2's task.
    pub task: Option<Task>,
    /// Where the text goes as it is generated, then the outcome.
    pub events: mpsc::UnboundedSender<Event>,
    /// When it was queued.
    pub queued: Instant,
}

/// What the worker tells a request.
#[derive(Debug)]
pub enum Event {
    /// New text (the caption so far grew by it).
    Delta(String),
    /// The end: the whole text and the generated token count, or why not.
    Done(Result<Finished, String>),
}

/// A finished caption.
#[derive(Debug, Clone)]
pub struct Finished {
    /// The text (as `vl caption` prints it).
    pub text: String,
    /// The generated ids.
    pub token_ids: Vec<u32>,
    /// Tokens generated.
    pub tokens: usize,
    /// Whether it ended at an end token (else at the length limit).
    pub stopped: bool,
    /// A task's parsed output, as `--json` carries it.
    pub task: Option<serde_json::Value>,
    /// With `attention_map`: per token, its text and its cross-attention
    /// weights over the image's patches.
    pub attention: Vec<(String, Vec<f32>)>,
}

/// Counters for `GET /metrics`.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Requests answered, by status code.
    pub by_status: Mutex<std::collections::BTreeMap<u16, u64>>,
    /// Tokens generated.
    pub tokens: AtomicU64,
    /// Requests waiting for the worker.
    pub queued: AtomicUsize,
    /// Batch sizes: counts of batches of 1, ≤2, ≤4, ≤8, ≤16, ≤32, more.
    pub batches: Mutex<[u64; 7]>,
    /// Time to first token, seconds: (sum, count).
    pub ttft: Mutex<(f64, u64)>,
    /// Latency to the last token, seconds: (sum, count).
    pub latency: Mutex<(f64, u64)>,
}

impl Metrics {
    /// Counts an answer of `status`.
    pub fn answered(&self, status: u16) {
        if let Ok(mut m) = self.by_status.lock() {
            *m.entry(status).or_default() += 1;
        }
    }

    fn batch(&self, n: usize) {
        let bucket = [1, 2, 4, 8, 16, 32]
            .iter()
            .position(|&b| n <= b)
            .unwrap_or(6);
        if let Ok(mut b) = self.batches.lock() {
            b[bucket] += 1;
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        out += "# HELP vl_requests_total Requests answered, by HTTP status.\n# TYPE vl_requests_total counter\n";
        if let Ok(m) = self.by_status.lock() {
            for (s, n) in m.iter() {
                out += &format!("vl_requests_total{{status=\"{s}\"}} {n}\n");
            }
        }
        out += &format!(
            "# HELP vl_generated_tokens_total Tokens generated.\n# TYPE vl_generated_tokens_total counter\nvl_generated_tokens_total {}\n",
            self.tokens.load(Ordering::Relaxed)
        );
        out += &format!(
            "# HELP vl_queue_depth Requests waiting for the model.\n# TYPE vl_queue_depth gauge\nvl_queue_depth {}\n",
            self.queued.load(Ordering::Relaxed)
        );
        out += "# HELP vl_batch_size Requests per batch.\n# TYPE vl_batch_size histogram\n";
        if let Ok(b) = self.batches.lock() {
            let mut cum = 0;
            for (i, le) in ["1", "2", "4", "8", "16", "32", "+Inf"].iter().enumerate() {
                cum += b[i];
                out += &format!("vl_batch_size_bucket{{le=\"{le}\"}} {cum}\n");
            }
            out += &format!("vl_batch_size_count {cum}\n");
        }
        for (name, help, m) in [
            (
                "vl_time_to_first_token_seconds",
                "Queueing, encoding and the first token.",
                &self.ttft,
            ),
            (
                "vl_request_latency_seconds",
                "Queueing to the last token.",
                &self.latency,
            ),
        ] {
            if let Ok(m) = m.lock() {
                out += &format!(
                    "# HELP {name} {help}\n# TYPE {name} summary\n{name}_sum {}\n{name}_count {}\n",
                    m.0, m.1
                );
            }
        }
        out
    }
}

fn observe(m: &Mutex<(f64, u64)>, since: Instant) {
    if let Ok(mut m) = m.lock() {
        m.0 += since.elapsed().as_secs_f64();
        m.1 += 1;
    }
}

/// Whether two jobs may share a batch: the same settings, not sampled.
fn batchable(a: &Job, b: &Job) -> bool {
    !matches!(a.generation.strategy, Strategy::Sample { .. })
        && a.generation == b.generation
        && a.prompt == b.prompt
        && a.task == b.task
}

/// Runs until every sender of `jobs` is gone, batching up to `max_batch`
/// requests.
pub fn run(
    captioner: Captioner,
    mut jobs: mpsc::Receiver<Job>,
    max_batch: usize,
    metrics: Arc<Metrics>,
) {
    while let Some(first) = jobs.blocking_recv() {
        let mut waiting = vec![first];
        while waiting.len() < max_batch {
            match jobs.try_recv() {
                Ok(j) => waiting.push(j),
                Err(_) => break,
            }
        }
        metrics.queued.fetch_sub(waiting.len(), Ordering::Relaxed);
        // Requests the client gave up on are not decoded.
        waiting.retain(|j| !j.events.is_closed());
        while !waiting.is_empty() {
            let head = waiting.remove(0);
            let (mut group, rest): (Vec<Job>, Vec<Job>) =
                waiting.into_iter().partition(|j| batchable(&head, j));
            waiting = rest;
            group.insert(0, head);
            metrics.batch(group.len());
            caption_group(&captioner, &group, &metrics);
        }
    }
}

/// Captions `group` in one batch (retried request by request if the
/// batch fails), streaming each request's text.
fn caption_group(captioner: &Captioner, group: &[Job], metrics: &Metrics) {
    let outcome = caption_batch(captioner, group, metrics);
    match outcome {
        Ok(()) => {}
        Err(_) if group.len() > 1 => {
            for job in group {
                if let Err(e) = caption_batch(captioner, std::slice::from_ref(job), metrics) {
                    let _ = job.events.send(Event::Done(Err(e)));
                }
            }
        }
        Err(e) => {
            let _ = group[0].events.send(Event::Done(Err(e)));
        }
    }
}

fn caption_batch(captioner: &Captioner, group: &[Job], metrics: &Metrics) -> Result<(), String> {
    let head = &group[0];
    let request = Request {
        generation: head.generation.clone(),
        prompt: head.prompt.as_deref(),
        task: head.task,
    };
    let pixels: Vec<Tensor> = group.iter().map(|j| j.pixels.clone()).collect();
    let sizes: Vec<(u32, u32)> = group.iter().map(|j| j.size).collect();
    let tokenizer = &captioner.model().tokenizer;
    let mut ids: Vec<Vec<u32>> = vec![Vec::new(); group.len()];
    let mut sent: Vec<String> = vec![String::new(); group.len()];
    let mut on_token = |ev: vl::vl_decoder::TokenEvent| {
        let Some(job) = group.get(ev.image) else {
            return;
        };
        if ids[ev.image].is_empty() {
            observe(&metrics.ttft, job.queued);
        }
        ids[ev.image].push(ev.token);
        // The text so far, decoded whole (a character may span tokens):
        // the new part is what grew.
        if let Ok(text) = tokenizer.decode(&ids[ev.image], true) {
            if let Some(delta) = text.strip_prefix(sent[ev.image].as_str()) {
                if !delta.is_empty() {
                    let _ = job.events.send(Event::Delta(delta.to_string()));
                }
                sent[ev.image] = text;
            }
        }
    };
    let captions = captioner
        .caption_pixels_sized(&pixels, &sizes, &request, &mut on_token)
        .map_err(|e| e.to_string())?;
    let eos = &head.generation.eos_token_ids;
    for (job, c) in group.iter().zip(captions) {
        metrics
            .tokens
            .fetch_add(c.token_ids.len() as u64, Ordering::Relaxed);
        observe(&metrics.latency, job.queued);
        let stopped = c.token_ids.last().is_some_and(|t| eos.contains(t));
        let task = c.task.as_ref().and_then(|t| serde_json::to_value(t).ok());
        // Each token's text as it grows the caption (a word's space
        // included), so that the pieces join to the text streamed.
        let mut before = String::new();
        let attention = c
            .heatmaps
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let upto = tokenizer
                    .decode(&c.token_ids[..=i], true)
                    .unwrap_or_default();
                let piece = upto
                    .strip_prefix(before.as_str())
                    .unwrap_or(&upto)
                    .to_string();
                before = upto;
                (piece, w.clone())
            })
            .collect();
        let _ = job.events.send(Event::Done(Ok(Finished {
            tokens: c.token_ids.len(),
            token_ids: c.token_ids,
            text: c.text,
            stopped,
            task,
            attention,
        })));
    }
    Ok(())
}
