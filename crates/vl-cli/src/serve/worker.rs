//! The one thread that owns the model, batching continuously: requests
//! that arrive while others decode are encoded and join the running batch
//! at the next step boundary, whatever their settings (greedy, sampled,
//! beams, tasks, heatmaps: each request decodes with its own search over
//! its own image, and its tokens are those it gets alone — see
//! `Captioner::step`); requests that end leave at once; a request whose
//! client went away is dropped at the next step. Each request's text is
//! streamed as its tokens are chosen.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::Tensor;
use tokio::sync::mpsc;
use vl::captioner::{Caption, Captioner, Captioning, Request};
use vl::tasks::Task;
use vl::vl_attn::kernels::KeepAwake;
use vl::vl_decoder::{GenerationConfig, TokenEvent};

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
    /// Requests in the running decode batch.
    pub running: AtomicUsize,
    /// Requests decoded together, per decode step: counts of steps of 1,
    /// ≤2, ≤4, ≤8, ≤16, ≤32, more.
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
        out += &format!(
            "# HELP vl_running_requests Requests in the running decode batch.\n# TYPE vl_running_requests gauge\nvl_running_requests {}\n",
            self.running.load(Ordering::Relaxed)
        );
        out += "# HELP vl_batch_size Requests decoded together, per decode step.\n# TYPE vl_batch_size histogram\n";
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

/// A request being decoded: its job, its caption in progress, and what
/// it has streamed.
struct Running<'t> {
    job: Job,
    captioning: Captioning,
    /// The text of the ids chosen so far (beam search: none until it ends).
    text: TextStream<'t>,
}

/// The tokenizer's incremental decoder of `tokenizers::Tokenizer`.
type DecodeStream<'t> = tokenizers::DecodeStream<
    't,
    tokenizers::models::ModelWrapper,
    tokenizers::normalizers::NormalizerWrapper,
    tokenizers::pre_tokenizers::PreTokenizerWrapper,
    tokenizers::processors::PostProcessorWrapper,
    tokenizers::decoders::DecoderWrapper,
>;

/// A request's text as its tokens arrive, in pieces whose concatenation is
/// the decoding of all its ids (special tokens skipped): the tokenizer's
/// [`DecodeStream`], which decodes a few ids a token — decoding every id
/// so far at each token made a request's streaming quadratic in its
/// length — and, should it refuse a token (a decoder that rewrites text
/// already sent), the whole ids decoded from then on, sending what
/// extends the text sent.
struct TextStream<'t> {
    tokenizer: &'t tokenizers::Tokenizer,
    /// `None` once it refused a token.
    stream: Option<DecodeStream<'t>>,
    ids: Vec<u32>,
    sent: String,
}

impl<'t> TextStream<'t> {
    fn new(tokenizer: &'t tokenizers::Tokenizer) -> Self {
        Self {
            tokenizer,
            stream: Some(tokenizer.decode_stream(true)),
            ids: Vec::new(),
            sent: String::new(),
        }
    }

    /// Whether no token came yet.
    fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The text `id` adds, if any (a character may need the next tokens).
    fn push(&mut self, id: u32) -> Option<String> {
        self.ids.push(id);
        if let Some(stream) = &mut self.stream {
            match stream.step(id) {
                Ok(piece) => {
                    let piece = piece.filter(|p| !p.is_empty())?;
                    self.sent.push_str(&piece);
                    return Some(piece);
                }
                Err(_) => self.stream = None,
            }
        }
        let text = self.tokenizer.decode(&self.ids, true).ok()?;
        let delta = text.strip_prefix(self.sent.as_str())?.to_string();
        self.sent = text;
        Some(delta).filter(|d| !d.is_empty())
    }
}

/// Runs until every sender of `jobs` is gone and the running requests
/// have ended: continuous batching. Between two decode steps, up to
/// `encode_batch` of the requests that arrived are encoded together and
/// join the running batch (of up to `max_batch` requests); each step
/// decodes one token of every running request in one pass of the decoder;
/// requests that end leave, and those whose client went away are dropped.
pub fn run(captioner: Captioner, jobs: mpsc::Receiver<Job>, limits: Limits, metrics: Arc<Metrics>) {
    run_observed(captioner, jobs, limits, &metrics, &mut |_| {});
}

/// How many requests the worker takes in.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Requests decoded together at most.
    pub max_batch: usize,
    /// Distinct images admitted (encoded together) between two decode
    /// steps at most — requests over one image (a request's choices) count
    /// once: the running requests wait for that encoding,
    /// and a large image batch encodes no faster per image than a small
    /// one on a CPU, so that taking a few at a time keeps the running
    /// requests streaming.
    pub encode_batch: usize,
}

/// [`run`], calling `before_step` with the running requests' count before
/// each decode step (tests hold a step there to send a request mid-decode).
fn run_observed(
    captioner: Captioner,
    mut jobs: mpsc::Receiver<Job>,
    limits: Limits,
    metrics: &Metrics,
    before_step: &mut dyn FnMut(usize),
) {
    let Limits {
        max_batch,
        encode_batch,
    } = limits;
    let mut running: Vec<Running> = Vec::new();
    let mut open = true;
    // A job taken from the queue whose image would have passed
    // `encode_batch`: the first of the next admission.
    let mut held: Option<Job> = None;
    // While requests run, the pool's workers stay awake between the
    // steps' parallel parts (see `KeepAwake`).
    let mut awake: Option<KeepAwake> = None;
    loop {
        // Admit: wait for work when idle, else take what has arrived, up
        // to `encode_batch` distinct images (a request's choices share
        // their image: one encoding, see `Captioner::start`).
        let mut arrived: Vec<Job> = Vec::new();
        if let Some(j) = held.take() {
            arrived.push(j);
        } else if running.is_empty() {
            awake = None;
            match jobs.blocking_recv() {
                Some(j) => arrived.push(j),
                None => return,
            }
        }
        while open && running.len() + arrived.len() < max_batch {
            match jobs.try_recv() {
                Ok(j) => {
                    let seen = |a: &Job| a.pixels.id() == j.pixels.id();
                    if !arrived.iter().any(seen) && images(&arrived) >= encode_batch {
                        held = Some(j);
                        break;
                    }
                    arrived.push(j);
                }
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => open = false,
            }
        }
        metrics.queued.fetch_sub(arrived.len(), Ordering::Relaxed);
        // Requests the client gave up on are not decoded further.
        arrived.retain(|j| !j.events.is_closed());
        running.retain(|r| !r.job.events.is_closed());
        if !arrived.is_empty() {
            let (n, t) = (arrived.len(), Instant::now());
            running.extend(admit(&captioner, arrived));
            tracing::debug!(
                "admitted {n} requests in {:.1} ms",
                t.elapsed().as_secs_f64() * 1e3
            );
        }
        metrics.running.store(running.len(), Ordering::Relaxed);
        if running.is_empty() {
            if open || held.is_some() {
                continue;
            }
            return;
        }
        awake.get_or_insert_with(|| KeepAwake::for_device(captioner.model().decoder.device()));
        before_step(running.len());
        metrics.batch(running.len());
        let (n, t) = (running.len(), Instant::now());
        step(&captioner, &mut running, metrics);
        metrics.running.store(running.len(), Ordering::Relaxed);
        tracing::debug!(
            "decoded {n} requests in {:.1} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
    }
}

/// The distinct images of `jobs` (clones of one pixel tensor count once).
fn images(jobs: &[Job]) -> usize {
    jobs.iter()
        .enumerate()
        .filter(|(i, j)| !jobs[..*i].iter().any(|a| a.pixels.id() == j.pixels.id()))
        .count()
}

/// Starts `jobs` (encoded together), answering those that cannot start;
/// if the batch fails as a whole, each job is started alone so that only
/// the bad one fails.
fn admit(captioner: &Captioner, jobs: Vec<Job>) -> Vec<Running<'_>> {
    if jobs.is_empty() {
        return Vec::new();
    }
    let started = start(captioner, &jobs);
    let outcomes: Vec<Result<Captioning, String>> = match started {
        Ok(each) => each,
        Err(_) if jobs.len() > 1 => jobs
            .iter()
            .map(|j| {
                start(captioner, std::slice::from_ref(j))
                    .and_then(|mut v| v.pop().unwrap_or_else(|| Err("not started".into())))
            })
            .collect(),
        Err(e) => vec![Err(e)],
    };
    jobs.into_iter()
        .zip(outcomes)
        .filter_map(|(job, outcome)| match outcome {
            Ok(captioning) => Some(Running {
                job,
                captioning,
                text: TextStream::new(&captioner.model().tokenizer),
            }),
            Err(e) => {
                let _ = job.events.send(Event::Done(Err(e)));
                None
            }
        })
        .collect()
}

fn start(captioner: &Captioner, jobs: &[Job]) -> Result<Vec<Result<Captioning, String>>, String> {
    let pixels: Vec<Tensor> = jobs.iter().map(|j| j.pixels.clone()).collect();
    let sizes: Vec<(u32, u32)> = jobs.iter().map(|j| j.size).collect();
    let requests: Vec<Request> = jobs
        .iter()
        .map(|j| Request {
            generation: j.generation.clone(),
            prompt: j.prompt.as_deref(),
            task: j.task,
        })
        .collect();
    let started = captioner
        .start(&pixels, &sizes, &requests)
        .map_err(|e| e.to_string())?;
    Ok(started
        .into_iter()
        .map(|r| r.map_err(|e| e.to_string()))
        .collect())
}

/// One decode step of every running request: streams the new text,
/// answers the requests that ended and removes them. A step that fails
/// fails the requests it was decoding (the model is unchanged for the
/// next ones).
fn step(captioner: &Captioner, running: &mut Vec<Running<'_>>, metrics: &Metrics) {
    let tokenizer = &captioner.model().tokenizer;
    let outcome = {
        let (mut captionings, mut streams): (Vec<&mut Captioning>, Vec<_>) = running
            .iter_mut()
            .map(|r| (&mut r.captioning, (&r.job, &mut r.text)))
            .unzip();
        captioner.step(&mut captionings, &mut |ev: TokenEvent| {
            let Some((job, text)) = streams.get_mut(ev.image) else {
                return;
            };
            if text.is_empty() {
                observe(&metrics.ttft, job.queued);
            }
            if let Some(delta) = text.push(ev.token) {
                let _ = job.events.send(Event::Delta(delta));
            }
        })
    };
    if let Err(e) = outcome {
        for r in running.drain(..) {
            let _ = r.job.events.send(Event::Done(Err(e.to_string())));
        }
        return;
    }
    for r in std::mem::take(running) {
        if !r.captioning.is_done() {
            running.push(r);
            continue;
        }
        let Running {
            job, captioning, ..
        } = r;
        let answer = captioner
            .finish(captioning)
            .map(|c| finished(&job, c, tokenizer, metrics))
            .map_err(|e| e.to_string());
        let _ = job.events.send(Event::Done(answer));
    }
}

/// A finished caption as the handlers answer it.
fn finished(
    job: &Job,
    c: Caption,
    tokenizer: &tokenizers::Tokenizer,
    metrics: &Metrics,
) -> Finished {
    metrics
        .tokens
        .fetch_add(c.token_ids.len() as u64, Ordering::Relaxed);
    observe(&metrics.latency, job.queued);
    let stopped = c
        .token_ids
        .last()
        .is_some_and(|t| job.generation.eos_token_ids.contains(t));
    let task = c.task.as_ref().and_then(|t| serde_json::to_value(t).ok());
    // Each token's text as it grows the caption (a word's space included),
    // so that the pieces join to the text streamed.
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
    Finished {
        tokens: c.token_ids.len(),
        token_ids: c.token_ids,
        text: c.text,
        stopped,
        task,
        attention,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vl::checkpoint::Source;

    const FOUR: Limits = Limits {
        max_batch: 4,
        encode_batch: 4,
    };

    fn load() -> Captioner {
        let source = Source::Memory {
            name: std::path::Path::new(crate::embedded::NAME),
            files: crate::embedded::SHAPES_CAPTIONER,
        };
        Captioner::new(vl::load(source, &vl::LoadOptions::default()).expect("the embedded model"))
    }

    /// A request's streamed pieces join to the decoding of its ids: each
    /// piece extends the text decoded so far (nothing sent is taken back),
    /// and at the end nothing is missing but a tail held for a character
    /// whose bytes never completed — on a tokenizer of each kind the
    /// families ship (the shapes captioner's, byte-level BPE, WordPiece),
    /// over seeded random ids (special ones, broken UTF-8 among them).
    #[test]
    fn streamed_text_joins_to_the_decoding() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut kinds = vec![("shapes", load().model().tokenizer.clone())];
        for dir in [
            "tests/fixtures/hf/equal",
            "tests/fixtures/blip/vision24",
            "tests/fixtures/florence2/tiny-a",
        ] {
            let t = tokenizers::Tokenizer::from_file(root.join(dir).join("tokenizer.json"))
                .unwrap_or_else(|e| panic!("{dir}: {e}"));
            kinds.push((dir, t));
        }
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = |below: u32| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % below as u64) as u32
        };
        for (name, tok) in &kinds {
            let vocab = tok.get_vocab_size(true) as u32;
            for len in [1, 2, 7, 40, 160] {
                let ids: Vec<u32> = (0..len).map(|_| next(vocab)).collect();
                let mut text = TextStream::new(tok);
                let mut joined = String::new();
                for (i, &id) in ids.iter().enumerate() {
                    if let Some(piece) = text.push(id) {
                        joined.push_str(&piece);
                    }
                    let so_far = tok.decode(&ids[..=i], true).expect("decode");
                    assert!(
                        so_far.starts_with(&joined),
                        "{name} {ids:?}: sent {joined:?}, the ids so far decode to {so_far:?}"
                    );
                }
                let whole = tok.decode(&ids, true).expect("decode");
                assert!(
                    joined == whole || whole.ends_with('\u{FFFD}'),
                    "{name} {ids:?}: sent {joined:?}, the ids decode to {whole:?}"
                );
            }
        }
    }

    fn job(
        captioner: &Captioner,
        scene: &str,
        generation: &GenerationConfig,
    ) -> (Job, mpsc::UnboundedReceiver<Event>) {
        let samples = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("models/shapes-captioner/samples");
        let img = vl::vl_vision::preprocess::load_image(&samples.join(scene)).expect("sample");
        let (events, rx) = mpsc::unbounded_channel();
        let job = Job {
            pixels: captioner.pixels(&img).expect("pixels"),
            size: (img.width(), img.height()),
            generation: generation.clone(),
            prompt: None,
            task: None,
            events,
            queued: Instant::now(),
        };
        (job, rx)
    }

    /// The request's answer, if it has come.
    fn answer(rx: &mut mpsc::UnboundedReceiver<Event>) -> Option<Finished> {
        while let Ok(e) = rx.try_recv() {
            if let Event::Done(d) = e {
                return Some(d.expect("captioned"));
            }
        }
        None
    }

    /// A request sent while another decodes joins it at the next step and
    /// leaves when it ends, before the long one; both get the caption
    /// they get alone.
    #[test]
    fn a_request_joins_a_running_decode_and_leaves_first() {
        let captioner = load();
        let greedy = captioner.greedy_config(15);
        // A runs to its 15th token; B is an ordinary caption.
        let long = GenerationConfig {
            min_new_tokens: 15,
            ..greedy.clone()
        };
        let alone = |scene: &str, g: &GenerationConfig| {
            let (j, mut rx) = job(&captioner, scene, g);
            let (tx, jobs) = mpsc::channel(1);
            tx.try_send(j).expect("queued");
            drop(tx);
            run(
                load(),
                jobs,
                Limits {
                    max_batch: 1,
                    encode_batch: 1,
                },
                Arc::new(Metrics::default()),
            );
            answer(&mut rx).expect("answered")
        };
        let a_alone = alone("scene_0000.png", &long);
        let b_alone = alone("scene_0001.png", &greedy);
        assert_eq!(a_alone.tokens, 15);
        assert!(b_alone.tokens < 15, "B should end before A: {b_alone:?}");

        let (a, mut a_rx) = job(&captioner, "scene_0000.png", &long);
        let (b, mut b_rx) = job(&captioner, "scene_0001.png", &greedy);
        let (tx, jobs) = mpsc::channel(4);
        tx.try_send(a).expect("queued");
        let metrics = Metrics::default();
        metrics.queued.store(1, Ordering::Relaxed);
        let mut sender = Some((tx, b));
        let mut steps = Vec::new();
        let mut b_out = None;
        run_observed(load(), jobs, FOUR, &metrics, &mut |running| {
            assert_eq!(metrics.running.load(Ordering::Relaxed), running);
            steps.push(running);
            if b_out.is_none() {
                b_out = answer(&mut b_rx).map(|f| (steps.len(), f));
            }
            // B is sent before the third step and joins at the fourth;
            // then no request comes: the worker ends when A does.
            if steps.len() == 3 {
                if let Some((tx, b)) = sender.take() {
                    metrics.queued.fetch_add(1, Ordering::Relaxed);
                    tx.try_send(b).expect("queued");
                }
            }
        });
        let a_out = answer(&mut a_rx).expect("A answered");
        let (b_step, b_out) = b_out.expect("B answered while A decoded");
        assert_eq!(a_out.token_ids, a_alone.token_ids);
        assert_eq!(b_out.token_ids, b_alone.token_ids);
        assert_eq!(b_out.text, b_alone.text);
        // A alone for three steps, then both until B ends, then A alone.
        assert_eq!(&steps[..4], &[1, 1, 1, 2], "{steps:?}");
        assert_eq!(steps.len(), 15, "A takes 15 steps: {steps:?}");
        assert_eq!(
            steps[b_step - 1],
            1,
            "B left before step {b_step}: {steps:?}"
        );
        assert_eq!(
            steps.iter().filter(|&&n| n == 2).count(),
            b_alone.tokens,
            "B decoded one token per shared step: {steps:?}"
        );
        assert_eq!(metrics.queued.load(Ordering::Relaxed), 0);
        assert_eq!(metrics.running.load(Ordering::Relaxed), 0);
        assert!(metrics.render().contains("vl_running_requests 0\n"));
    }

    /// A client that goes away mid-decode frees its row at the next step;
    /// the request beside it is untouched.
    #[test]
    fn a_client_that_leaves_frees_its_row_at_the_next_step() {
        let captioner = load();
        let long = GenerationConfig {
            min_new_tokens: 15,
            ..captioner.greedy_config(15)
        };
        let (a, mut a_rx) = job(&captioner, "scene_0002.png", &long);
        let (c, c_rx) = job(&captioner, "scene_0003.png", &long);
        let (tx, jobs) = mpsc::channel(4);
        tx.try_send(a).expect("queued");
        tx.try_send(c).expect("queued");
        drop(tx);
        let metrics = Metrics::default();
        metrics.queued.store(2, Ordering::Relaxed);
        let mut c_rx = Some(c_rx);
        let mut steps = Vec::new();
        run_observed(load(), jobs, FOUR, &metrics, &mut |running| {
            steps.push(running);
            if steps.len() == 3 {
                // The client hangs up (its receiver is dropped).
                c_rx = None;
            }
        });
        assert!(c_rx.is_none());
        assert_eq!(&steps[..4], &[2, 2, 2, 1], "{steps:?}");
        assert_eq!(steps.len(), 15, "{steps:?}");
        let a_out = answer(&mut a_rx).expect("A answered");
        assert_eq!(a_out.tokens, 15);
    }

    /// Requests over one pixel tensor (a request's choices) count as one
    /// image toward `encode_batch`: both join the first step together, the
    /// image encoded once; a third over another image waits a step.
    #[test]
    fn choices_of_one_image_are_admitted_together() {
        let captioner = load();
        let greedy = captioner.greedy_config(15);
        let (a, mut a_rx) = job(&captioner, "scene_0004.png", &greedy);
        let (mut b, mut b_rx) = job(&captioner, "scene_0004.png", &greedy);
        b.pixels = a.pixels.clone();
        let (c, mut c_rx) = job(&captioner, "scene_0005.png", &greedy);
        let (tx, jobs) = mpsc::channel(4);
        for j in [a, b, c] {
            tx.try_send(j).expect("queued");
        }
        drop(tx);
        let metrics = Metrics::default();
        metrics.queued.store(3, Ordering::Relaxed);
        let limits = Limits {
            max_batch: 4,
            encode_batch: 1,
        };
        let mut steps = Vec::new();
        run_observed(load(), jobs, limits, &metrics, &mut |n| steps.push(n));
        assert_eq!(&steps[..2], &[2, 3], "{steps:?}");
        let (a, b) = (answer(&mut a_rx).expect("a"), answer(&mut b_rx).expect("b"));
        assert_eq!(a.token_ids, b.token_ids);
        assert!(answer(&mut c_rx).is_some());
        assert_eq!(metrics.queued.load(Ordering::Relaxed), 0);
    }
}
