//! `vl serve` as a process on loopback with the embedded shapes captioner:
//! OpenAI-shaped answers equal to `vl caption`'s captions (16 concurrent
//! requests over 8 images), streaming, bad input answered with a 4xx
//! naming the field while the server keeps answering, and SIGTERM.
#![allow(missing_docs)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use common::{images, ok, run, s, vl_bin};
use serde_json::{json, Value};

struct Server {
    child: Child,
    base: String,
}

impl Server {
    fn start(extra: &[&str]) -> Self {
        let mut child = Command::new(vl_bin())
            .args(["serve", "--port", "0"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn vl serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("the address line");
        let base = line
            .trim()
            .strip_prefix("listening on ")
            .expect("listening on http://…")
            .to_string();
        let server = Self { child, base };
        let start = Instant::now();
        while ureq::get(&format!("{}/health", server.base))
            .call()
            .is_err()
        {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "not ready in 60 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    fn post(&self, body: &str) -> (u16, Value) {
        let r = ureq::post(&format!("{}/v1/chat/completions", self.base))
            .set("content-type", "application/json")
            .send_string(body);
        match r {
            Ok(r) => (r.status(), r.into_json().expect("json")),
            Err(ureq::Error::Status(code, r)) => (code, r.into_json().expect("json error")),
            Err(e) => panic!("transport error: {e}"),
        }
    }

    fn terminate(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill");
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "no exit 30 s after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
    }
}

fn data_url(path: &std::path::Path) -> String {
    let bytes = std::fs::read(path).expect("image");
    format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

fn request(url: &str, extra: Value) -> String {
    let mut body = json!({
        "model": "shapes-captioner",
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in the image?"},
            {"type": "image_url", "image_url": {"url": url}},
        ]}],
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    body.to_string()
}

#[test]
fn answers_equal_vl_caption_and_bad_input_is_named() {
    let tmp = tempfile::tempdir().expect("tmp");
    let imgs = images(&tmp.path().join("imgs"), 8);
    // The reference: `vl caption` on each image, one process.
    let want: Vec<String> = ok(&run(&imgs.iter().map(|p| s(p)).collect::<Vec<_>>()))
        .lines()
        .map(|l| l.split_once(": ").expect("path: caption").1.to_string())
        .collect();
    assert_eq!(want.len(), 8);

    let server = Server::start(&["--max-batch", "8", "--max-body-mib", "1"]);
    let models: Value = ureq::get(&format!("{}/v1/models", server.base))
        .call()
        .expect("models")
        .into_json()
        .expect("json");
    assert_eq!(models["data"][0]["id"], "shapes-captioner");

    // 16 concurrent requests over the 8 images: each is its caption.
    let urls: Vec<String> = imgs.iter().map(|p| data_url(p)).collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..16)
            .map(|i| {
                let (server, url) = (&server, &urls[i % 8]);
                scope.spawn(move || (i, server.post(&request(url, json!({})))))
            })
            .collect();
        for h in handles {
            let (i, (status, body)) = h.join().expect("thread");
            assert_eq!(status, 200, "{body}");
            assert_eq!(body["object"], "chat.completion");
            assert_eq!(
                body["choices"][0]["message"]["content"],
                want[i % 8],
                "request {i}"
            );
            assert_eq!(body["choices"][0]["finish_reason"], "stop");
            let usage = &body["usage"];
            assert_eq!(
                usage["total_tokens"].as_u64(),
                Some(
                    usage["prompt_tokens"].as_u64().unwrap()
                        + usage["completion_tokens"].as_u64().unwrap()
                )
            );
        }
    });

    // Streaming: the deltas make the same caption, then [DONE].
    let r = ureq::post(&format!("{}/v1/chat/completions", server.base))
        .send_string(&request(&urls[3], json!({"stream": true})))
        .expect("stream");
    let mut text = String::new();
    let mut done = false;
    for line in BufReader::new(r.into_reader()).lines() {
        let line = line.expect("line");
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            break;
        }
        let chunk: Value = serde_json::from_str(data).expect("chunk");
        assert_eq!(chunk["object"], "chat.completion.chunk");
        if let Some(d) = chunk["choices"][0]["delta"]["content"].as_str() {
            text.push_str(d);
        }
    }
    assert!(done, "no [DONE]");
    assert_eq!(text, want[3]);

    // n choices: greedy ones are the caption each; sampled ones draw from
    // seed, seed + 1, …: the first is the single sampled answer.
    let (status, body) = server.post(&request(&urls[2], json!({"n": 3})));
    assert_eq!(status, 200, "{body}");
    let choices = body["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["message"]["content"], want[2]);
    }
    let completion: u64 = body["usage"]["completion_tokens"].as_u64().expect("usage");
    let (_, one) = server.post(&request(&urls[2], json!({})));
    assert_eq!(
        completion,
        3 * one["usage"]["completion_tokens"].as_u64().expect("usage")
    );
    let sampled = |n: usize, seed: u64| {
        let (status, body) = server.post(&request(
            &urls[2],
            json!({"n": n, "temperature": 1.5, "seed": seed}),
        ));
        assert_eq!(status, 200, "{body}");
        body["choices"]
            .as_array()
            .expect("choices")
            .iter()
            .map(|c| c["message"]["content"].as_str().expect("text").to_string())
            .collect::<Vec<_>>()
    };
    let four = sampled(4, 11);
    assert_eq!(four[0], sampled(1, 11)[0]);
    assert_eq!(four[1], sampled(1, 12)[0]);
    // Streamed, each choice's deltas make its text.
    let r = ureq::post(&format!("{}/v1/chat/completions", server.base))
        .send_string(&request(
            &urls[2],
            json!({"n": 4, "temperature": 1.5, "seed": 11, "stream": true}),
        ))
        .expect("stream");
    let mut texts = vec![String::new(); 4];
    let mut finished = 0;
    for line in BufReader::new(r.into_reader()).lines() {
        let line = line.expect("line");
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(data).expect("chunk");
        let c = &chunk["choices"][0];
        let i = c["index"].as_u64().expect("index") as usize;
        if let Some(d) = c["delta"]["content"].as_str() {
            texts[i].push_str(d);
        }
        finished += usize::from(!c["finish_reason"].is_null());
    }
    assert_eq!(finished, 4);
    assert_eq!(texts, four);

    // Bad input: a 4xx naming the field, the server unharmed.
    let garbage = format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(b"not an image at all")
    );
    let image_param = "messages[0].content[1].image_url.url";
    let cases: Vec<(String, u16, &str)> = vec![
        ("{\"messages\": [".into(), 400, "body"),
        (
            request("data:image/png;base64,@@@", json!({})),
            400,
            image_param,
        ),
        (
            request("https://example.com/cat.png", json!({})),
            400,
            image_param,
        ),
        (request(&garbage, json!({})), 400, image_param),
        (request(&urls[0], json!({"model": "gpt-4o"})), 404, "model"),
        (
            request(&urls[0], json!({"max_tokens": 1000})),
            400,
            "max_tokens",
        ),
        (
            request(&urls[0], json!({"max_tokens": 4, "min_tokens": 5})),
            400,
            "min_tokens",
        ),
        (
            request(&urls[0], json!({"temperature": 3.0})),
            400,
            "temperature",
        ),
        (request(&urls[0], json!({"n": 17})), 400, "n"),
        (request(&urls[0], json!({"task": "od"})), 400, "task"),
        (
            json!({"messages": [{"role": "user", "content": "hi"}]}).to_string(),
            400,
            "messages",
        ),
        (
            json!({"messages": [{"role": "user", "content": 7}]}).to_string(),
            400,
            "messages[0].content",
        ),
    ];
    for (body, status, param) in &cases {
        let (got, err) = server.post(body);
        assert_eq!(got, *status, "{param}: {err}");
        assert_eq!(err["error"]["param"], *param, "{err}");
        assert!(err["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
    // Over --max-body-mib 1: refused from its Content-Length, before the
    // body (sent here only after the answer, so that the server's early
    // close cannot race the upload).
    {
        use std::io::{Read, Write};
        let addr = server.base.trim_start_matches("http://");
        let mut tcp = std::net::TcpStream::connect(addr).expect("connect");
        write!(
            tcp,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            2 << 20
        )
        .expect("headers");
        tcp.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let mut head = [0u8; 12];
        tcp.read_exact(&mut head).expect("status line");
        assert_eq!(&head, b"HTTP/1.1 413", "{}", String::from_utf8_lossy(&head));
    }
    let (status, body) = server.post(&request(&urls[5], json!({})));
    assert_eq!(status, 200);
    assert_eq!(body["choices"][0]["message"]["content"], want[5]);
    let metrics = ureq::get(&format!("{}/metrics", server.base))
        .call()
        .expect("metrics")
        .into_string()
        .expect("text");
    assert!(
        metrics.contains("vl_requests_total{status=\"200\"} 24"),
        "{metrics}"
    );
    assert!(
        metrics.contains("vl_requests_total{status=\"404\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("# TYPE vl_running_requests gauge\nvl_running_requests "),
        "{metrics}"
    );

    // SIGTERM: exit 0.
    let status = server.terminate();
    assert!(status.success(), "{status}");
}

/// A full queue answers 429 with `Retry-After`; the requests it took are
/// answered right, and so is the next one.
#[test]
fn a_full_queue_answers_429() {
    let tmp = tempfile::tempdir().expect("tmp");
    let imgs = images(&tmp.path().join("imgs"), 1);
    let want = ok(&run(&[s(&imgs[0])])).trim().to_string();
    let server = Server::start(&["--max-queue", "1", "--max-batch", "1"]);
    let url = data_url(&imgs[0]);
    let statuses: Vec<(u16, Option<String>, Value)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..32)
            .map(|_| {
                let (server, url) = (&server, &url);
                scope.spawn(move || {
                    let r = ureq::post(&format!("{}/v1/chat/completions", server.base))
                        .send_string(&request(url, json!({})));
                    match r {
                        Ok(r) => (200, None, r.into_json().expect("json")),
                        Err(ureq::Error::Status(code, r)) => {
                            let retry = r.header("retry-after").map(String::from);
                            (code, retry, r.into_json().expect("json"))
                        }
                        Err(e) => panic!("{e}"),
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });
    let refused: Vec<_> = statuses.iter().filter(|(c, _, _)| *c == 429).collect();
    assert!(
        !refused.is_empty(),
        "32 requests at once into a queue of 1: none refused"
    );
    for (code, retry, body) in &statuses {
        match code {
            200 => assert_eq!(body["choices"][0]["message"]["content"], want),
            429 => {
                assert_eq!(retry.as_deref(), Some("1"));
                assert_eq!(body["error"]["code"], "queue_full");
            }
            other => panic!("status {other}: {body}"),
        }
    }
    let (status, body) = server.post(&request(&url, json!({})));
    assert_eq!(status, 200);
    assert_eq!(body["choices"][0]["message"]["content"], want);
}

/// `POST /v1/caption`: a multipart upload → `vl caption --json`'s lines,
/// in upload order, a bad image only its own error line.
#[test]
fn multipart_upload_gives_vl_caption_json_lines() {
    let tmp = tempfile::tempdir().expect("tmp");
    let imgs = images(&tmp.path().join("imgs"), 2);
    let want: Vec<Value> = ok(&run(&["--json", s(&imgs[0]), s(&imgs[1])]))
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    let server = Server::start(&[]);
    let boundary = "vl-test-boundary";
    let mut body = Vec::new();
    let files: [(&str, Vec<u8>); 3] = [
        ("a.png", std::fs::read(&imgs[0]).expect("png")),
        ("broken.png", b"not an image".to_vec()),
        ("b.png", std::fs::read(&imgs[1]).expect("png")),
    ];
    for (name, bytes) in &files {
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"{name}\"\r\nContent-Type: image/png\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(bytes);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    let text = ureq::post(&format!("{}/v1/caption", server.base))
        .set(
            "content-type",
            &format!("multipart/form-data; boundary={boundary}"),
        )
        .send_bytes(&body)
        .expect("caption upload")
        .into_string()
        .expect("text");
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert_eq!(lines[0]["image"], "a.png");
    assert_eq!(lines[0]["caption"], want[0]["caption"]);
    assert_eq!(lines[0]["token_ids"], want[0]["token_ids"]);
    assert_eq!(lines[1]["image"], "broken.png");
    assert!(
        lines[1]["error"]
            .as_str()
            .is_some_and(|e| e.contains("not an image")),
        "{}",
        lines[1]
    );
    assert_eq!(lines[2]["caption"], want[1]["caption"]);
}

/// A Florence-2 checkpoint behind the server: a task by vl's field or as
/// the message's task token, its parsed output under the processor's key
/// in `message.vl_task`, equal to `vl caption --task --json`'s.
#[test]
fn florence2_tasks_are_served() {
    let model = common::repo_root().join("tests/fixtures/florence2/tiny-a");
    let image = model.join("other.png");
    let want: Value = serde_json::from_str(
        ok(&run(&[
            "--model",
            s(&model),
            "--task",
            "od",
            "--json",
            "--max-tokens",
            "8",
            s(&image),
        ]))
        .trim(),
    )
    .expect("json");
    let server = Server::start(&["--model", s(&model)]);
    let url = data_url(&image);
    let body = json!({
        "model": "tiny-a",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "<OD>"},
            {"type": "image_url", "image_url": {"url": url}},
        ]}],
    });
    let (status, got) = server.post(&body.to_string());
    assert_eq!(status, 200, "{got}");
    let message = &got["choices"][0]["message"];
    assert_eq!(message["content"], want["caption"]);
    assert_eq!(message["vl_task"]["<OD>"], want["<OD>"]);
    // vl's `task` field with an image alone; with a text the task cannot
    // take, the request is refused rather than the text dropped.
    let image_only = json!({
        "model": "tiny-a", "task": "od", "max_tokens": 8,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}],
    });
    let (status, got) = server.post(&image_only.to_string());
    assert_eq!(status, 200, "{got}");
    assert_eq!(
        got["choices"][0]["message"]["vl_task"]["<OD>"],
        want["<OD>"]
    );
    let (status, err) = server.post(&request(&url, json!({"model": "tiny-a", "task": "od"})));
    assert_eq!(status, 400, "{err}");
    assert!(err["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("takes no text input")));
    // A task that needs an input, given none: named.
    let mut no_input = image_only.clone();
    no_input["task"] = json!("phrase-grounding");
    let (status, err) = server.post(&no_input.to_string());
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["error"]["param"], "messages");
}

/// `--allow-local-files DIR`: a `file://` URL under DIR is captioned as
/// its bytes would be; one outside DIR is a 400 naming the URL's field;
/// a folder that does not exist stops the server at start.
#[test]
fn local_files_are_read_only_under_the_allowed_folder() {
    let tmp = tempfile::tempdir().expect("tmp");
    let imgs = images(&tmp.path().join("imgs"), 2);
    let want = ok(&run(&[s(&imgs[0])])).trim().to_string();
    let outside = tmp.path().join("outside.png");
    std::fs::copy(&imgs[1], &outside).expect("copy");
    let dir = tmp.path().join("imgs");
    let server = Server::start(&["--allow-local-files", s(&dir)]);
    let file_url =
        |p: &std::path::Path| format!("file://{}", p.canonicalize().expect("path").display());
    let (status, body) = server.post(&request(&file_url(&imgs[0]), json!({})));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], want);
    let (status, body) = server.post(&request(&file_url(&outside), json!({})));
    assert_eq!(status, 400, "{body}");
    assert_eq!(
        body["error"]["param"],
        "messages[0].content[1].image_url.url"
    );
    drop(server);
    let out = Command::new(vl_bin())
        .args(["serve", "--port", "0", "--allow-local-files"])
        .arg(tmp.path().join("missing"))
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--allow-local-files"), "{err}");
}
