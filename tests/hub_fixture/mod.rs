//! A stand-in for the Hugging Face Hub on loopback: the requests and the
//! headers that hf-hub 0.4's blocking client makes and reads, answered from
//! fixture files held in memory. Shared by `tests/hub.rs` and
//! `crates/vl-cli/tests/hub.rs`.
//!
//! - `GET /api/models/{org}/{name}/revision/{revision}`: `{"sha", "siblings"}`.
//! - `GET /{org}/{name}/resolve/{revision}/{file}`: the file, with `etag` and
//!   `x-repo-commit`; weights (`*.safetensors`) answer as the Hub answers
//!   for LFS files: a 302 to `/blobs/{etag}` (the CDN) carrying
//!   `x-linked-etag` and `x-repo-commit`.
//! - `GET /blobs/{etag}`: an LFS file's bytes.
//!
//! Files honour `Range` (206 with `content-range`). A revision is its name
//! or its commit. The refusals are the Hub's: 401 `RepositoryNotFound` (what
//! anonymous clients get), 404 `RevisionNotFound`, 404 `EntryNotFound`, each
//! in `x-error-code`.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, Request, State};
use axum::http::header::{CONTENT_LENGTH, CONTENT_RANGE, ETAG, LOCATION, RANGE};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use futures_util::{stream, StreamExt};

/// Every test's bound: a fetch that hangs fails the test instead.
pub const TEST_LIMIT: Duration = Duration::from_secs(60);

/// The variables ureq reads for a proxy (it has no `NO_PROXY`): with one
/// set, even loopback requests would go through it.
const PROXY_VARS: &[&str] = &[
    "ALL_PROXY",
    "all_proxy",
    "HTTPS_PROXY",
    "https_proxy",
    "HTTP_PROXY",
    "http_proxy",
];

/// One revision of a repository: its files, and names it lists without
/// serving them.
#[derive(Clone)]
pub struct Revision {
    repo: String,
    name: String,
    files: BTreeMap<String, Bytes>,
    listed_only: Vec<String>,
}

impl Revision {
    /// Revision `name` (a branch such as `main` or `refs/pr/1`) of `repo`
    /// (`ORG/NAME`), empty.
    pub fn new(repo: &str, name: &str) -> Self {
        Self {
            repo: repo.into(),
            name: name.into(),
            files: BTreeMap::new(),
            listed_only: Vec::new(),
        }
    }

    /// Adds the files `names` of `dir`.
    pub fn with_files_of(mut self, dir: &Path, names: &[&str]) -> Self {
        for name in names {
            let path = dir.join(name);
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            self.files.insert(name.to_string(), bytes.into());
        }
        self
    }

    /// Adds the file `name` with `bytes`.
    pub fn with_file(mut self, name: &str, bytes: impl Into<Bytes>) -> Self {
        self.files.insert(name.into(), bytes.into());
        self
    }

    /// Lists `name` among the files but answers 404 for it.
    pub fn with_listed_only(mut self, name: &str) -> Self {
        self.listed_only.push(name.into());
        self
    }

    /// The commit this revision names: 40 hex digits, derived from the
    /// repository, the name and the files.
    pub fn commit(&self) -> String {
        let mut h = DefaultHasher::new();
        (&self.repo, &self.name, &self.files, &self.listed_only).hash(&mut h);
        format!("{:040x}", h.finish())
    }
}

/// The ETag of a file's content (the Hub's is its git or LFS hash).
pub fn etag(bytes: &[u8]) -> String {
    let mut h = DefaultHasher::new();
    bytes.hash(&mut h);
    format!("{:016x}", h.finish())
}

/// One request the server received.
#[derive(Clone, Debug)]
pub struct Logged {
    /// The path, as sent (revisions' `/` escaped as `%2F`).
    pub path: String,
    /// The `Range` header, if any.
    pub range: Option<String>,
}

struct Shared {
    url: String,
    revisions: Vec<Revision>,
    blobs: HashMap<String, Bytes>,
    log: Mutex<Vec<Logged>>,
    /// The ETag of a file whose next download breaks off halfway.
    interrupt: Mutex<Option<String>>,
}

impl Shared {
    fn revision(&self, repo: &str, revision: &str) -> Result<&Revision, Refusal> {
        let mut of_repo = self.revisions.iter().filter(|r| r.repo == repo).peekable();
        if of_repo.peek().is_none() {
            return Err(Refusal(StatusCode::UNAUTHORIZED, "RepositoryNotFound"));
        }
        of_repo
            .find(|r| r.name == revision || r.commit() == revision)
            .ok_or(Refusal(StatusCode::NOT_FOUND, "RevisionNotFound"))
    }
}

/// The Hub on loopback, serving until dropped (or [`FixtureHub::stop`]).
pub struct FixtureHub {
    shared: Arc<Shared>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl FixtureHub {
    /// Serves `revisions` on 127.0.0.1, on a port of the system's choosing.
    pub fn start(revisions: Vec<Revision>) -> Self {
        if let Some(var) = PROXY_VARS.iter().find(|v| std::env::var_os(v).is_some()) {
            panic!(
                "{var} is set: hf-hub's client (ureq 2) would send even loopback requests \
                 through that proxy; unset it to run the Hub tests"
            );
        }
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let blobs = revisions
            .iter()
            .flat_map(|r| r.files.values())
            .map(|b| (etag(b), b.clone()))
            .collect();
        let shared = Arc::new(Shared {
            url,
            revisions,
            blobs,
            log: Mutex::new(Vec::new()),
            interrupt: Mutex::new(None),
        });
        let app = Router::new()
            .route("/api/models/{org}/{name}/revision/{revision}", get(info))
            .route("/{org}/{name}/resolve/{revision}/{*file}", get(resolve))
            .route("/blobs/{etag}", get(blob))
            .layer(middleware::from_fn_with_state(shared.clone(), log))
            .with_state(shared.clone());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                let serve = std::future::IntoFuture::into_future(axum::serve(listener, app));
                // Stopping drops the listener; dropping the runtime closes
                // the connections.
                futures_util::future::select(Box::pin(serve), stopped).await;
            });
        });
        Self {
            shared,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// The endpoint, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> &str {
        &self.shared.url
    }

    /// The requests received since the last call.
    pub fn take_requests(&self) -> Vec<Logged> {
        std::mem::take(&mut self.shared.log.lock().expect("log"))
    }

    /// Breaks off the next download of the file holding `bytes` halfway,
    /// once: the connection closes before the promised length.
    pub fn interrupt_once(&self, bytes: &[u8]) {
        *self.shared.interrupt.lock().expect("interrupt") = Some(etag(bytes));
    }

    /// Stops answering: connections are refused from now on.
    pub fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            // Err: the server thread ended already.
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            thread.join().expect("the fixture Hub's thread panicked");
        }
    }
}

impl Drop for FixtureHub {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs `body` on its own thread and fails the test if it takes longer
/// than [`TEST_LIMIT`] (hf-hub's client has no timeouts of its own).
pub fn within<T: Send + 'static>(body: impl FnOnce() -> T + Send + 'static) -> T {
    let (done, finished) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        let out = body();
        let _ = done.send(());
        out
    });
    match finished.recv_timeout(TEST_LIMIT) {
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("the test ran over {TEST_LIMIT:?}"),
        // Finished, or panicked (the sender dropped): join says which.
        _ => worker
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
    }
}

async fn log(State(hub): State<Arc<Shared>>, request: Request, next: Next) -> Response {
    let range = request
        .headers()
        .get(RANGE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let path = request.uri().path().to_string();
    hub.log.lock().expect("log").push(Logged { path, range });
    next.run(request).await
}

async fn info(
    State(hub): State<Arc<Shared>>,
    UrlPath((org, name, revision)): UrlPath<(String, String, String)>,
) -> Response {
    let rev = match hub.revision(&format!("{org}/{name}"), &revision) {
        Ok(rev) => rev,
        Err(refused) => return refused.into_response(),
    };
    let siblings: Vec<_> = rev
        .files
        .keys()
        .chain(&rev.listed_only)
        .map(|f| serde_json::json!({ "rfilename": f }))
        .collect();
    let body = serde_json::json!({
        "id": rev.repo,
        "sha": rev.commit(),
        "siblings": siblings,
    });
    ([("content-type", "application/json")], body.to_string()).into_response()
}

async fn resolve(
    State(hub): State<Arc<Shared>>,
    UrlPath((org, name, revision, file)): UrlPath<(String, String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let rev = match hub.revision(&format!("{org}/{name}"), &revision) {
        Ok(rev) => rev,
        Err(refused) => return refused.into_response(),
    };
    let Some(bytes) = rev.files.get(&file) else {
        return Refusal(StatusCode::NOT_FOUND, "EntryNotFound").into_response();
    };
    let tag = etag(bytes);
    let commit = rev.commit();
    if file.ends_with(".safetensors") {
        let location = format!("{}/blobs/{tag}", hub.url);
        return (
            StatusCode::FOUND,
            [
                (LOCATION.as_str(), location),
                ("x-repo-commit", commit),
                ("x-linked-etag", format!("\"{tag}\"")),
                ("x-linked-size", bytes.len().to_string()),
            ],
        )
            .into_response();
    }
    let mut response = ranged(&hub, bytes, &headers);
    let h = response.headers_mut();
    h.insert(ETAG, format!("\"{tag}\"").parse().expect("etag"));
    h.insert("x-repo-commit", commit.parse().expect("commit"));
    response
}

async fn blob(
    State(hub): State<Arc<Shared>>,
    UrlPath(tag): UrlPath<String>,
    headers: HeaderMap,
) -> Response {
    match hub.blobs.get(&tag) {
        Some(bytes) => ranged(&hub, bytes, &headers),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

/// `bytes`, or the part `Range: bytes=START-[END]` asks for; broken off
/// halfway if [`FixtureHub::interrupt_once`] named them.
fn ranged(hub: &Shared, bytes: &Bytes, headers: &HeaderMap) -> Response {
    let size = bytes.len();
    let range = headers
        .get(RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("bytes="))
        .and_then(|v| v.split_once('-'));
    let Some((start, end)) = range else {
        return (StatusCode::OK, bytes.clone()).into_response();
    };
    let start: usize = start.parse().unwrap_or(size);
    let end: usize = end.parse().unwrap_or(size.saturating_sub(1));
    let end = end.min(size.saturating_sub(1));
    if start > end || start >= size {
        return (
            StatusCode::RANGE_NOT_SATISFIABLE,
            [(CONTENT_RANGE, format!("bytes */{size}"))],
        )
            .into_response();
    }
    let part = bytes.slice(start..=end);
    let content_range = format!("bytes {start}-{end}/{size}");
    let mut interrupt = hub.interrupt.lock().expect("interrupt");
    // The 1-byte probe that asks for the size is answered in full.
    let body = if part.len() > 1 && interrupt.as_deref() == Some(&etag(bytes)) {
        *interrupt = None;
        let half = part.slice(..part.len() / 2);
        // The error comes a turn later, once the half has left: an error at
        // once would close the connection before the head was sent, which
        // the client takes for a stale kept-alive connection and retries.
        let cut = async {
            tokio::task::yield_now().await;
            Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "the fixture Hub cut the download",
            ))
        };
        Body::from_stream(stream::once(async { Ok(half) }).chain(stream::once(cut)))
    } else {
        Body::from(part.clone())
    };
    (
        StatusCode::PARTIAL_CONTENT,
        [
            (CONTENT_RANGE, content_range),
            (CONTENT_LENGTH, part.len().to_string()),
        ],
        body,
    )
        .into_response()
}

/// A refusal as the Hub words it: a status and its `x-error-code`.
struct Refusal(StatusCode, &'static str);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let Self(status, code) = self;
        let body = serde_json::json!({ "error": code }).to_string();
        (status, [("x-error-code", code)], body).into_response()
    }
}
