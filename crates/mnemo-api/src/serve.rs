//! The HTTP/1 listener, with the limits a hostile client would otherwise exploit: a request's
//! head must arrive within the header timeout (which also closes idle keep-alive connections),
//! its body within the body timeout, and a response must not wait longer than the write timeout
//! on a client that stopped reading it; and at most so many connections are served at once (the
//! others wait in the listen queue). axum's own `serve` sets no timer, so none applies there: a
//! client sending one header line a second held its connection for as long as it liked.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::HttpBody as _;
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use futures_util::StreamExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// How long a client may take to send and to read, and how many may be connected at once.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// From the moment a connection waits for a request until its head has arrived.
    pub header: Duration,
    /// From the head until the last byte of the body.
    pub body: Duration,
    /// How long a write may wait on a client that reads nothing.
    pub write: Duration,
    /// Connections served at once.
    pub connections: usize,
}

impl ConnectionLimits {
    pub fn of(settings: &mnemo_config::ServerSettings) -> Self {
        Self {
            header: settings.header_timeout,
            body: settings.body_timeout,
            write: settings.write_timeout,
            connections: settings.max_client_connections,
        }
    }
}

/// How long in-flight requests get to finish once shutdown begins.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// Serves `router` on `listener` until `shutdown` resolves, then lets in-flight requests finish
/// (for at most [`SHUTDOWN_GRACE`]).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    timeouts: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let router =
        router.layer(axum::middleware::from_fn(move |request, next| body_deadline(timeouts.body, request, next)));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(timeouts.header);
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(timeouts.connections.max(1)));
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        // Past the cap, new connections wait in the kernel's listen queue.
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, most likely: back off rather than spin.
                    tracing::warn!(error = %e, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let stream = WriteDeadline { stream, limit: timeouts.write, stalled: None };
        let connection = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(router.clone()));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                // Timeouts and clients that hang up land here; none is the server's fault.
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop(slot);
        });
    }
    drop(listener);
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown()).await.is_err() {
        tracing::warn!("requests still running {} s after shutdown began were cut off", SHUTDOWN_GRACE.as_secs());
    }
    Ok(())
}

/// The error a body stream ends with when its deadline passes; [`crate::body`] answers it with
/// 408.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive in time")]
pub struct BodyTimedOut;

/// Ends the request's body with [`BodyTimedOut`] if it is still arriving `limit` after the head.
async fn body_deadline(limit: Duration, request: Request, next: Next) -> Response {
    if request.body().is_end_stream() {
        return next.run(request).await; // no body (GET, DELETE): nothing to wait for
    }
    let deadline = tokio::time::Instant::now() + limit;
    let request = request.map(|body| {
        let frames = body.into_data_stream();
        axum::body::Body::from_stream(futures_util::stream::unfold(Some(frames), move |frames| async move {
            let mut frames = frames?;
            match tokio::time::timeout_at(deadline, frames.next()).await {
                Ok(Some(frame)) => Some((frame.map_err(axum::BoxError::from), Some(frames))),
                Ok(None) => None,
                Err(_) => Some((Err(axum::BoxError::from(BodyTimedOut)), None)),
            }
        }))
    });
    next.run(request).await
}

/// A connection whose writes fail once one has waited `limit` for a client that reads nothing
/// (its window closed): hyper has no write timeout, and such a client would hold its task, its
/// buffered response and its descriptor for as long as it answers TCP's probes.
struct WriteDeadline {
    stream: TcpStream,
    limit: Duration,
    /// Armed when a write first waits; disarmed by any progress.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl WriteDeadline {
    fn waited<T>(&mut self, cx: &mut Context<'_>, poll: Poll<std::io::Result<T>>) -> Poll<std::io::Result<T>> {
        if poll.is_ready() {
            self.stalled = None;
            return poll;
        }
        let limit = self.limit;
        let stalled = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match stalled.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the client read nothing for the write timeout",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for WriteDeadline {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteDeadline {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let poll = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.waited(cx, poll)
    }

    // hyper writes a response's head and body in one vectored write when the stream can.
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let poll = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.waited(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let poll = Pin::new(&mut self.stream).poll_flush(cx);
        self.waited(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let poll = Pin::new(&mut self.stream).poll_shutdown(cx);
        self.waited(cx, poll)
    }
}
