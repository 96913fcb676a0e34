//! Server-sent events from a request's worker events, and collecting them for a
//! non-streaming reply.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures_util::Stream;
use tokio::sync::mpsc::UnboundedReceiver;

use super::error::ApiError;
use super::job::{Event, Outcome};

/// Waits for a request's whole output.
pub async fn collect(mut rx: UnboundedReceiver<Event>) -> Result<Outcome, ApiError> {
    while let Some(e) = rx.recv().await {
        match e {
            Event::Text(_)
            | Event::Reasoning(_)
            | Event::CallStart { .. }
            | Event::CallArgs { .. } => {}
            Event::Done(o) => return Ok(o),
            Event::Failed(e) => return Err(e),
        }
    }
    Err(ApiError::internal(
        "the engine dropped the request without an answer",
    ))
}

/// Turns worker events into SSE events: `prelude` first, then `convert` for each
/// worker event (it returns the SSE events to send and whether the stream ends).
pub fn sse<F>(
    rx: UnboundedReceiver<Event>,
    prelude: Vec<SseEvent>,
    convert: F,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>>
where
    F: FnMut(Event) -> (Vec<SseEvent>, bool) + Send + 'static,
{
    struct State<F> {
        rx: UnboundedReceiver<Event>,
        queued: VecDeque<SseEvent>,
        convert: F,
        ended: bool,
    }
    let state = State {
        rx,
        queued: prelude.into(),
        convert,
        ended: false,
    };
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(e) = s.queued.pop_front() {
                return Some((Ok(e), s));
            }
            if s.ended {
                return None;
            }
            match s.rx.recv().await {
                Some(ev) => {
                    let (events, end) = (s.convert)(ev);
                    s.queued.extend(events);
                    s.ended = end;
                }
                None => {
                    // The worker is gone without a last event: end the stream.
                    s.ended = true;
                }
            }
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}
