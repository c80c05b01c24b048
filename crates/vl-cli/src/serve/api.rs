//! The OpenAI chat-completions protocol as `vl serve` speaks it: the
//! request body (with vl's extra fields), the response and stream chunk
//! shapes, and the error object that names the field at fault.

use std::collections::BTreeMap;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// An error answered to the client: an HTTP status and OpenAI's error
/// object (`{"error": {"message", "type", "param", "code"}}`), `param`
/// naming the request field at fault.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What is wrong, with the values involved.
    pub message: String,
    /// The request field at fault (`messages[0].content[1].image_url.url`).
    pub param: Option<String>,
    /// A stable code (`invalid_request_error`, `queue_full`, …).
    pub code: &'static str,
    /// Seconds a client should wait before retrying (429).
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// 400, naming `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.into()),
            code: "invalid_request_error",
            retry_after: None,
        }
    }

    /// Another status, naming `param` when there is one.
    pub fn new(
        status: StatusCode,
        code: &'static str,
        param: Option<&str>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            message: message.into(),
            param: param.map(String::from),
            code,
            retry_after: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        serde_json::json!({"error": {
            "message": self.message,
            "type": if self.status.is_server_error() { "server_error" } else { "invalid_request_error" },
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            if let Ok(v) = s.to_string().parse() {
                response.headers_mut().insert("retry-after", v);
            }
        }
        response
    }
}

/// `POST /v1/chat/completions`'s body. Unknown fields are ignored, as
/// OpenAI-compatible servers do; vl's own are `min_tokens`, `num_beams`,
/// `task` and `attention_map`.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    /// The served model's id (`GET /v1/models`); absent = the served one.
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation: one image in total, and text parts.
    pub messages: Vec<Message>,
    /// Most new tokens (`max_completion_tokens` is its newer name).
    #[serde(default)]
    pub max_tokens: Option<usize>,
    /// The newer name of `max_tokens`.
    #[serde(default)]
    pub max_completion_tokens: Option<usize>,
    /// Sampling temperature, 0..=2 (0 or absent: greedy).
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Nucleus sampling, (0, 1].
    #[serde(default)]
    pub top_p: Option<f64>,
    /// The sampling seed.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Choices per request (1 only).
    #[serde(default)]
    pub n: Option<usize>,
    /// Server-sent events, one chunk per token.
    #[serde(default)]
    pub stream: Option<bool>,
    /// vl (as vLLM's extra parameter): generate at least this many tokens
    /// before an end token may end the answer.
    #[serde(default)]
    pub min_tokens: Option<usize>,
    /// vl: beam search with this many beams.
    #[serde(default)]
    pub num_beams: Option<usize>,
    /// vl: Florence-2's task (`od`, `<OD>`, …).
    #[serde(default)]
    pub task: Option<String>,
    /// vl: return each token's cross-attention over the image's patches
    /// (`message.vl_attention`; when streaming, in the last chunk).
    #[serde(default)]
    pub attention_map: Option<bool>,
    /// Everything else, ignored.
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

/// One message.
#[derive(Debug, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`.
    pub role: String,
    /// Text, or content parts.
    pub content: Content,
}

/// A message's content.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Text and image parts.
    Parts(Vec<Part>),
}

/// A content part.
#[derive(Debug, Deserialize)]
#[serde(tag = "type")]
pub enum Part {
    /// `{"type": "text", "text": …}`.
    #[serde(rename = "text")]
    Text {
        /// The text.
        text: String,
    },
    /// `{"type": "image_url", "image_url": {"url": …}}`.
    #[serde(rename = "image_url")]
    ImageUrl {
        /// The image.
        image_url: ImageUrl,
    },
}

/// An image part's URL: a `data:` URL here.
#[derive(Debug, Deserialize)]
pub struct ImageUrl {
    /// `data:image/png;base64,…`.
    pub url: String,
    /// OpenAI's detail hint, ignored.
    #[serde(default)]
    pub detail: Option<String>,
}

/// Token counts of a response.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Usage {
    /// The image's tokens and the prompt's.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
}

/// Parses a body, naming the field at fault (`messages[0].content`).
pub fn parse_request(body: &[u8]) -> Result<ChatRequest, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            ApiError::invalid("body", format!("not JSON: {inner}"))
        } else {
            let param = if path == "." {
                "body".to_string()
            } else {
                path
            };
            ApiError::invalid(param, inner.to_string())
        }
    })
}

/// The bytes of a `data:` URL (base64 or percent-free plain data).
pub fn data_url_bytes(url: &str, param: &str) -> Result<Vec<u8>, ApiError> {
    use base64::Engine;
    if url.starts_with("http://") || url.starts_with("https://") {
        return Err(ApiError::invalid(
            param,
            "remote image URLs are not fetched (the server makes no outbound requests); send the image as a data URL: data:image/png;base64,…",
        ));
    }
    if url.starts_with("file://") {
        return Err(ApiError::invalid(
            param,
            "local files are read only under the folder given to --allow-local-files; send the image as a data URL: data:image/png;base64,…",
        ));
    }
    let Some(rest) = url.strip_prefix("data:") else {
        return Err(ApiError::invalid(
            param,
            "expected a data URL (data:image/png;base64,…)",
        ));
    };
    let Some((meta, data)) = rest.split_once(',') else {
        return Err(ApiError::invalid(
            param,
            "a data URL without a ',' before its data",
        ));
    };
    if !meta.ends_with(";base64") {
        return Err(ApiError::invalid(
            param,
            "only base64 data URLs are taken (data:…;base64,…)",
        ));
    }
    base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|e| ApiError::invalid(param, format!("invalid base64: {e}")))
}

/// Where a request's image comes from.
#[derive(Debug)]
pub enum ImageData {
    /// A data URL's bytes.
    Bytes(Vec<u8>),
    /// A `file://` URL under `--allow-local-files`: the file, resolved.
    File(std::path::PathBuf),
}

/// The image of an `image_url`: a data URL's bytes, or with `local` (the
/// resolved `--allow-local-files` folder) a `file://` URL naming a file
/// inside it (links resolved first, so that none leads out); `param` is
/// named in every error.
pub fn image_data(
    url: &str,
    param: &str,
    local: Option<&std::path::Path>,
) -> Result<ImageData, ApiError> {
    let (Some(root), Some(path)) = (local, url.strip_prefix("file://")) else {
        return data_url_bytes(url, param).map(ImageData::Bytes);
    };
    let resolved = std::path::Path::new(path)
        .canonicalize()
        .map_err(|e| ApiError::invalid(param, format!("cannot read {path}: {e}")))?;
    if !resolved.starts_with(root) || !resolved.is_file() {
        return Err(ApiError::invalid(
            param,
            format!(
                "{path} is not a file under {} (--allow-local-files)",
                root.display()
            ),
        ));
    }
    Ok(ImageData::File(resolved))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_files_only_under_the_allowed_folder() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("allowed");
        std::fs::create_dir(&root).unwrap();
        std::fs::write(root.join("a.png"), b"x").unwrap();
        std::fs::write(tmp.path().join("secret.png"), b"x").unwrap();
        let root = root.canonicalize().unwrap();
        let url = |p: &std::path::Path| format!("file://{}", p.display());
        // Without the flag, refused by name.
        let e = image_data(&url(&root.join("a.png")), "u", None).unwrap_err();
        assert!(e.message.contains("--allow-local-files"), "{e:?}");
        assert!(matches!(
            image_data(&url(&root.join("a.png")), "u", Some(&root)),
            Ok(ImageData::File(p)) if p == root.join("a.png")
        ));
        // Outside, through `..`, a folder, a missing file: the param named.
        for bad in [
            tmp.path().join("secret.png"),
            root.join("../secret.png"),
            root.clone(),
            root.join("missing.png"),
        ] {
            let e = image_data(&url(&bad), "u", Some(&root)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("u"), "{bad:?}");
        }
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(tmp.path().join("secret.png"), root.join("link.png"))
                .unwrap();
            let e = image_data(&url(&root.join("link.png")), "u", Some(&root)).unwrap_err();
            assert!(e.message.contains("not a file under"), "{e:?}");
        }
        // Data URLs still work with the flag.
        assert!(matches!(
            image_data("data:image/png;base64,AAEC", "u", Some(&root)),
            Ok(ImageData::Bytes(b)) if b == [0, 1, 2]
        ));
    }

    #[test]
    fn fields_at_fault_are_named() {
        let e =
            parse_request(b"{\"messages\": [{\"role\": \"user\", \"content\": 3}]}").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content"), "{e:?}");
        let e = parse_request(b"{not json").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("body"));
        let e = parse_request(b"{\"messages\": [], \"max_tokens\": \"ten\"}").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = data_url_bytes("https://example.com/a.png", "url").unwrap_err();
        assert!(e.message.contains("not fetched"));
        let e = data_url_bytes("data:image/png;base64,@@@", "url").unwrap_err();
        assert!(e.message.contains("invalid base64"));
        assert_eq!(
            data_url_bytes("data:image/png;base64,AAEC", "u").unwrap(),
            vec![0, 1, 2]
        );
    }
}
