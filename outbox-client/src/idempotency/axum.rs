//! axum integration: the [`IdempotentRequest`] extractor and
//! [`Idempotency::respond`], which runs a handler idempotently and answers
//! with its response, a replay, 409 or 422.
//!
//! ```no_run
//! use axum::extract::State;
//! use axum::http::StatusCode;
//! use axum::response::Response;
//! use outbox_client::idempotency::axum::IdempotentRequest;
//! use outbox_client::idempotency::Idempotency;
//!
//! #[derive(Clone)]
//! struct App {
//!     pool: deadpool_postgres::Pool,
//!     idempotency: Idempotency,
//! }
//!
//! async fn grant(State(app): State<App>, request: IdempotentRequest) -> Response {
//!     let Ok(mut client) = app.pool.get().await else {
//!         return StatusCode::SERVICE_UNAVAILABLE.into_response();
//!     };
//!     let scope = "user:42 POST /credits"; // from the authenticated principal
//!     app.idempotency
//!         .respond(&mut client, scope, &request, |tx| {
//!             Box::pin(async move {
//!                 tx.execute("UPDATE accounts SET credits = credits + 100 WHERE id = 42", &[])
//!                     .await
//!                     .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
//!                 // outbox_client::enqueue(tx, &message) here commits with it
//!                 Ok::<_, StatusCode>((StatusCode::CREATED, "granted"))
//!             })
//!         })
//!         .await
//! }
//! # use axum::response::IntoResponse;
//! ```
//!
//! | situation                              | response |
//! |----------------------------------------|----------|
//! | no `Idempotency-Key` header            | 400      |
//! | key empty, over 255 bytes, not visible ASCII, or sent twice | 400 |
//! | first request                          | the handler's response, stored |
//! | handler returned `Err`                 | the error's response, nothing stored or committed |
//! | retry of a completed request           | the stored response + `Idempotent-Replayed: true` |
//! | same key, another method, path or body | 422      |
//! | same key, request still running        | 409 + `Retry-After` (or the replay, in wait mode) |
//!
//! A handler's `Ok` response is stored whatever its status: return `Err` for
//! failures a retry should run again (a 5xx, a lost connection), `Ok` for
//! answers it should get again (a 201, or a 4xx such as "insufficient funds").
//!
//! hyper drops a handler's future when the client disconnects. The
//! transaction then rolls back, so nothing is half-applied and the retry runs
//! the request again. To let a request that the client gave up on finish and
//! commit anyway, so that the retry gets its response, run `respond` in a
//! spawned task on an owned pooled connection, as `examples/credits.rs` does.

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Request};
use axum::http::header::{HeaderName, HeaderValue, RETRY_AFTER};
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use tokio_postgres::{Client, Transaction};

use super::{
    rollback, Begin, BoxFuture, Error, Fingerprint, Idempotency, IdempotencyKey, StoredResponse,
};

/// The request header carrying the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The response header marking a replayed response; its value is `true`.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// A request that carries a valid `Idempotency-Key`, with its body buffered
/// and fingerprinted.
///
/// It consumes the body, so it must be a handler's last extractor; the body
/// is available from [`IdempotentRequest::body`]. The body limit is axum's
/// (`DefaultBodyLimit`, 2 MB unless changed).
#[derive(Debug, Clone)]
pub struct IdempotentRequest {
    key: IdempotencyKey,
    fingerprint: Fingerprint,
    method: Method,
    uri: Uri,
    body: Bytes,
}

impl IdempotentRequest {
    /// The validated key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// SHA-256 over method, path with query, and body.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    /// The request method.
    pub fn method(&self) -> &Method {
        &self.method
    }

    /// The request URI as this router saw it.
    pub fn uri(&self) -> &Uri {
        &self.uri
    }

    /// The request body.
    pub fn body(&self) -> &Bytes {
        &self.body
    }
}

/// Why [`IdempotentRequest`] rejected a request. Each answers 400 except a
/// body rejection, which keeps axum's own status (e.g. 413).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdempotencyRejection {
    /// The header is absent.
    #[error("missing Idempotency-Key header: this endpoint requires one, generate a unique value (e.g. a UUID) per operation and send the same one on every retry")]
    MissingKey,
    /// The header appears more than once.
    #[error("more than one Idempotency-Key header: send exactly one")]
    RepeatedKey,
    /// The header's value breaks the rules.
    #[error("invalid Idempotency-Key header: {0}")]
    InvalidKey(#[source] Error),
    /// The body could not be read.
    #[error("request body could not be read")]
    Body(#[source] axum::extract::rejection::BytesRejection),
}

impl IntoResponse for IdempotencyRejection {
    fn into_response(self) -> Response {
        match self {
            IdempotencyRejection::Body(rejection) => rejection.into_response(),
            other => (StatusCode::BAD_REQUEST, other.to_string()).into_response(),
        }
    }
}

impl<S: Send + Sync> FromRequest<S> for IdempotentRequest {
    type Rejection = IdempotencyRejection;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let mut values = req.headers().get_all(&IDEMPOTENCY_KEY).iter();
        let value = values.next().ok_or(IdempotencyRejection::MissingKey)?;
        if values.next().is_some() {
            return Err(IdempotencyRejection::RepeatedKey);
        }
        // Non-ASCII bytes fail to_str; IdempotencyKey names the rule either way.
        let key = IdempotencyKey::new(value.to_str().unwrap_or("\u{0}"))
            .map_err(IdempotencyRejection::InvalidKey)?;
        let method = req.method().clone();
        let uri = req.uri().clone();
        let body = Bytes::from_request(req, state)
            .await
            .map_err(IdempotencyRejection::Body)?;
        let path = uri.path_and_query().map_or(uri.path(), |p| p.as_str());
        let fingerprint = Fingerprint::new(method.as_str(), path, &body);
        Ok(IdempotentRequest {
            key,
            fingerprint,
            method,
            uri,
            body,
        })
    }
}

impl Idempotency {
    /// Runs `handler` idempotently for `request` and answers with the result.
    ///
    /// Like [`Idempotency::run`]: a new transaction on `client`, the record
    /// written in it, `handler` given the transaction for its writes and
    /// outbox messages, the response stored and everything committed together.
    /// The first request gets the handler's full response; a replay gets the
    /// stored status, the stored headers ([`Idempotency::replay_headers`]) and
    /// the same body bytes, plus [`IDEMPOTENT_REPLAYED`]. See the
    /// [module docs](self) for every other answer.
    pub async fn respond<F, R, E>(
        &self,
        client: &mut Client,
        scope: &str,
        request: &IdempotentRequest,
        handler: F,
    ) -> Response
    where
        F: for<'t> FnOnce(&'t Transaction<'t>) -> BoxFuture<'t, Result<R, E>>,
        R: IntoResponse,
        E: IntoResponse,
    {
        match self.respond_inner(client, scope, request, handler).await {
            Ok(response) => response,
            Err(e) => {
                tracing::error!(error = %ErrorChain(&e), scope, key = %request.key, "idempotent request failed");
                if e.is_retryable() {
                    (
                        StatusCode::SERVICE_UNAVAILABLE,
                        [(RETRY_AFTER, retry_after_value(self.retry_after))],
                        "temporarily unavailable, retry with the same Idempotency-Key",
                    )
                        .into_response()
                } else {
                    (StatusCode::INTERNAL_SERVER_ERROR, "internal error").into_response()
                }
            }
        }
    }

    async fn respond_inner<F, R, E>(
        &self,
        client: &mut Client,
        scope: &str,
        request: &IdempotentRequest,
        handler: F,
    ) -> Result<Response, Error>
    where
        F: for<'t> FnOnce(&'t Transaction<'t>) -> BoxFuture<'t, Result<R, E>>,
        R: IntoResponse,
        E: IntoResponse,
    {
        let tx = client.transaction().await.map_err(Error::Database)?;
        let pending = match self
            .begin(&tx, scope, &request.key, &request.fingerprint)
            .await?
        {
            Begin::New(pending) => pending,
            Begin::Replay(stored) => {
                rollback(tx).await;
                return Ok(replay(stored));
            }
            Begin::InProgress { retry_after } => {
                rollback(tx).await;
                return Ok((
                    StatusCode::CONFLICT,
                    [(RETRY_AFTER, retry_after_value(retry_after))],
                    "a request with this Idempotency-Key is still being processed; retry later",
                )
                    .into_response());
            }
            Begin::Mismatch => {
                rollback(tx).await;
                return Ok((
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "this Idempotency-Key was already used with a different request \
                     (method, path or body); use a new key for a new request",
                )
                    .into_response());
            }
        };
        let response = match handler(&tx).await {
            Ok(r) => r.into_response(),
            Err(e) => {
                rollback(tx).await;
                return Ok(e.into_response());
            }
        };
        let (parts, body) = response.into_parts();
        let body = match axum::body::to_bytes(body, self.max_response_bytes).await {
            Ok(bytes) => bytes,
            Err(e) => {
                rollback(tx).await;
                tracing::error!(error = %e, scope, key = %request.key,
                    limit = self.max_response_bytes, "response body could not be stored");
                return Ok((StatusCode::INTERNAL_SERVER_ERROR, "internal error").into_response());
            }
        };
        let stored = StoredResponse {
            status: parts.status.as_u16(),
            headers: parts
                .headers
                .iter()
                .filter(|(name, _)| self.is_replay_header(name.as_str()))
                .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
                .collect(),
            body: body.to_vec(),
        };
        self.complete(&tx, pending, &stored).await?;
        tx.commit().await.map_err(Error::Database)?;
        Ok(Response::from_parts(parts, Body::from(body)))
    }
}

/// The stored response as an axum response, marked as a replay. A stored
/// header that is no longer a valid header is left out rather than failing
/// the replay.
fn replay(stored: StoredResponse) -> Response {
    let mut response = Response::new(Body::from(stored.body));
    *response.status_mut() =
        StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&value),
        ) {
            headers.append(name, value);
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

/// `Retry-After` in whole seconds, rounded up, at least 1.
fn retry_after_value(d: std::time::Duration) -> HeaderValue {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    HeaderValue::from(secs.max(1))
}

/// Displays an error with its `source()` chain, for logs.
struct ErrorChain<'a>(&'a (dyn std::error::Error + 'static));

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(s) = source {
            write!(f, ": {s}")?;
            source = s.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(retry_after_value(Duration::ZERO), "1");
        assert_eq!(retry_after_value(Duration::from_millis(1500)), "2");
        assert_eq!(retry_after_value(Duration::from_secs(3)), "3");
    }

    #[tokio::test]
    async fn replay_keeps_status_headers_and_bytes_and_marks_itself() {
        let response = replay(StoredResponse::new(
            201,
            vec![
                ("content-type".into(), b"application/json".to_vec()),
                ("location".into(), b"/credits/7".to_vec()),
            ],
            b"{\"id\":7}".to_vec(),
        ));
        assert_eq!(response.status(), StatusCode::CREATED);
        assert_eq!(response.headers()["content-type"], "application/json");
        assert_eq!(response.headers()["location"], "/credits/7");
        assert_eq!(response.headers()[IDEMPOTENT_REPLAYED], "true");
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("in-memory body");
        assert_eq!(&body[..], b"{\"id\":7}");
    }
}
