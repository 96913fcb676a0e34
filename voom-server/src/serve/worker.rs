//! The engine worker: one engine resident at a time, on a thread of its own, running
//! one request at a time in arrival order (a FIFO queue: fair, and a queued request
//! waits rather than fails). A request for another model swaps the engine.
//!
//! A request's output goes back over a channel as text pieces, already cut at its
//! stop sequences. When the client goes away its receiver is dropped: the next token
//! notices, generation stops and the engine moves on at once; a request whose client
//! left while it was queued is skipped.
//!
//! Constrained requests run through `Engine::generate_constrained` with the job's
//! compiled grammar. Requests with tools have their output held back and parsed at
//! the end: the text without the calls goes out as one piece, the calls in the
//! outcome. JSON output (a response format) streams as it comes and is validated
//! against its schema at the end.

use std::ops::ControlFlow;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use libvoom::engine::{Decoding, Engine, FinishReason};
use libvoom::speculate::Drafter;
use libvoom::text::StreamDecoder;
use serde_json::Value;
use vpaged::PageSource;

use super::catalog::ModelMeta;
use super::error::{ApiError, Kind};
use super::ids::new_id;
use super::job::{Event, Finish, Job, Outcome};
use super::metrics::Metrics;
use super::stop::StopScanner;
use super::tools::{
    adopt_streamed, is_number_overflow, text_after, CallGate, CallPiece, CallStreamer,
};
use crate::cli::common::{EngineArgs, SpecArgs, Speculation};

/// The engine loaded now.
struct Resident {
    model: String,
    source: Arc<dyn PageSource>,
}

/// Handle to the worker thread.
pub struct Worker {
    tx: Mutex<mpsc::Sender<Job>>,
    metrics: Arc<Metrics>,
    resident: Arc<Mutex<Option<Resident>>>,
    /// Jobs that may wait; past them, submissions are refused (429).
    max_queue: usize,
}

impl Worker {
    pub fn spawn(
        engine_args: EngineArgs,
        spec: SpecArgs,
        metrics: Arc<Metrics>,
        max_queue: usize,
    ) -> std::io::Result<Worker> {
        let (tx, rx) = mpsc::channel::<Job>();
        let resident = Arc::new(Mutex::new(None));
        let state = WorkerState {
            engine_args,
            spec,
            speculation: Speculation::Off,
            engine: None,
            metrics: Arc::clone(&metrics),
            resident: Arc::clone(&resident),
        };
        std::thread::Builder::new()
            .name("voom-engine".into())
            .spawn(move || state.run(rx))?;
        Ok(Worker {
            tx: Mutex::new(tx),
            metrics,
            resident,
            max_queue,
        })
    }

    /// Queues a job; its events arrive on `job.events`. A full queue is a 429
    /// whose `Retry-After` is the queue's expected wait.
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        // Under the sender's lock, so the check and the count are one step.
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let depth = self.metrics.queue_depth.load(Ordering::Relaxed);
        if depth >= self.max_queue {
            self.metrics
                .rejected_queue_full
                .fetch_add(1, Ordering::Relaxed);
            let busy = self.metrics.busy.load(Ordering::Relaxed);
            let wait = self.metrics.mean_generation_secs().unwrap_or(1.0) * (depth + busy) as f64;
            let mut e = ApiError::new(
                Kind::Overloaded,
                format!(
                    "the server is busy: {depth} requests are waiting for the engine (--max-queue {})",
                    self.max_queue
                ),
            );
            e.retry_after = Some((wait.ceil() as u64).clamp(1, 600));
            return Err(e);
        }
        self.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
        tx.send(job).map_err(|_| {
            self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
            ApiError::internal("the engine worker has stopped")
        })
    }

    /// The model whose engine is resident, if any.
    pub fn resident(&self) -> Option<String> {
        self.resident
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|r| r.model.clone())
    }

    /// The resident engine's page source (for its cache statistics).
    pub fn resident_source(&self) -> Option<Arc<dyn PageSource>> {
        self.resident
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|r| Arc::clone(&r.source))
    }

    pub fn queue_depth(&self) -> usize {
        self.metrics.queue_depth.load(Ordering::Relaxed)
    }
}

struct WorkerState {
    engine_args: EngineArgs,
    /// Speculative decoding as `voom serve` was asked, and its drafter for the
    /// resident engine.
    spec: SpecArgs,
    speculation: Speculation,
    engine: Option<Engine>,
    metrics: Arc<Metrics>,
    resident: Arc<Mutex<Option<Resident>>>,
}

impl WorkerState {
    fn run(mut self, rx: mpsc::Receiver<Job>) {
        while let Ok(job) = rx.recv() {
            self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
            if job.events.is_closed() {
                // The client left while the request was queued.
                self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            self.metrics.busy.store(1, Ordering::Relaxed);
            let events = job.events.clone();
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.serve(job)));
            let event = match r {
                Ok(Ok(Some(outcome))) => Some(Event::Done(outcome)),
                Ok(Ok(None)) => None,
                Ok(Err(e)) => Some(Event::Failed(e)),
                Err(panic) => {
                    let what = panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    tracing::error!("the engine panicked: {what}");
                    // The engine's state is unknown after a panic: load it afresh.
                    self.engine = None;
                    *self.resident.lock().unwrap_or_else(|e| e.into_inner()) = None;
                    Some(Event::Failed(ApiError::internal(format!(
                        "the engine failed: {what}"
                    ))))
                }
            };
            // Idle before the client hears the end, so /metrics never lags the reply.
            self.metrics.busy.store(0, Ordering::Relaxed);
            if let Some(e) = event {
                let _ = events.send(e);
            }
        }
    }

    /// The engine for `meta`, swapping out another model's.
    fn engine_for(&mut self, meta: &ModelMeta) -> Result<&Engine, ApiError> {
        let same = self
            .engine
            .as_ref()
            .is_some_and(|e| e.dir() == meta.dir.as_path());
        if !same {
            // Drop the old engine first: one model's pages resident at a time.
            self.engine = None;
            self.speculation = Speculation::Off;
            *self.resident.lock().unwrap_or_else(|e| e.into_inner()) = None;
            let t = Instant::now();
            let e = crate::cli::common::open_engine(&meta.dir, &self.engine_args)
                .map_err(|e| ApiError::model_unavailable(&meta.id, &e))?;
            tracing::info!(
                "loaded model {} in {:.2}s ({})",
                meta.id,
                t.elapsed().as_secs_f64(),
                e.source().describe()
            );
            self.metrics.model_loads.fetch_add(1, Ordering::Relaxed);
            // A draft model drafts for the models that share its tokenizer; the others
            // decode plainly.
            self.speculation = match self.spec.open(&e, &self.engine_args) {
                Ok(s) => s,
                Err(err) => {
                    tracing::warn!("model {}: no speculative decoding: {err:#}", meta.id);
                    Speculation::Off
                }
            };
            self.engine = Some(e);
            *self.resident.lock().unwrap_or_else(|e| e.into_inner()) = Some(Resident {
                model: meta.id.clone(),
                source: self.engine.as_ref().expect("just loaded").source_arc(),
            });
        }
        Ok(self.engine.as_ref().expect("set above"))
    }

    /// Runs one job. `Ok(None)`: the client went away.
    fn serve(&mut self, mut job: Job) -> Result<Option<Outcome>, ApiError> {
        let started = Instant::now();
        let queue_secs = (started - job.enqueued).as_secs_f64();
        self.engine_for(&job.request.meta)?;
        // A drafter of its own per request; the draft length as `voom serve` was asked.
        let mut drafter = self.speculation.drafter();
        let mut params = job.request.params.clone();
        self.spec.apply(&mut params);
        let engine = self.engine.as_ref().expect("loaded above");
        let tok = engine.tokenizer().ok_or_else(|| {
            ApiError::internal(format!(
                "model '{}' has no tokenizer.json",
                job.request.meta.id
            ))
        })?;
        let eos = engine.eos_ids().to_vec();
        if let Some(g) = job.request.grammar.as_ref().filter(|g| g.eos != eos) {
            // The grammar leaves the eos ids to the engine: both must mean the same ids.
            return Err(ApiError::internal(format!(
                "the grammar for model '{}' was compiled with end-of-sequence ids {:?}, but the engine stops on {:?}",
                job.request.meta.id, g.eos, eos
            )));
        }
        // With tools, text streams until a call may be starting (CallGate); from there
        // on output is held back, because calls are only known at the end. Forced
        // calls are streamed as they are written instead (CallStreamer): the grammar
        // admits only valid ones.
        let mut gate = job
            .request
            .tools
            .as_ref()
            .map(|t| CallGate::new(t.format, t.forced));
        let mut calls = job
            .request
            .tools
            .as_ref()
            .filter(|t| t.forced)
            .map(|t| CallStreamer::new(t.format));
        let mut call_ids: Vec<String> = Vec::new();
        let keep_special = job
            .request
            .tools
            .as_ref()
            .is_some_and(|t| t.format.keep_special_tokens);
        let mut dec = StreamDecoder::new(tok, !keep_special);
        // Stop sequences cut text. A forced call is no text (its grammar ends it), so
        // they do not apply there: a `stop` of "\n" or "Observation:", as agent loops
        // pass, would otherwise cut every call.
        let forced = job.request.tools.as_ref().is_some_and(|t| t.forced);
        let mut out = StopScanner::new(if forced { &[] } else { &job.request.stop });
        let mut text = String::new();
        let mut gone = false;
        let mut failure = None;
        let mut send = |piece: &str, text: &mut String| -> bool {
            if piece.is_empty() {
                return true;
            }
            text.push_str(piece);
            for p in calls.as_mut().map(|c| c.push(piece)).unwrap_or_default() {
                let ev = match p {
                    CallPiece::Start { index, name } => {
                        let id = new_id("call_");
                        call_ids.push(id.clone());
                        Event::CallStart { index, id, name }
                    }
                    CallPiece::Args { index, text } => Event::CallArgs { index, text },
                };
                if job.events.send(ev).is_err() {
                    return false;
                }
            }
            let emit = match gate.as_mut() {
                Some(g) => g.push(piece),
                None => piece.to_string(),
            };
            if emit.is_empty() {
                return !job.events.is_closed();
            }
            job.events.send(Event::Text(emit)).is_ok()
        };
        let mut on_token = |id| {
            if eos.contains(&id) && !job.request.params.ignore_eos {
                return ControlFlow::Continue(());
            }
            let piece = match dec.push(id) {
                Ok(p) => p,
                Err(e) => {
                    failure = Some(ApiError::internal(format!("detokenizing: {e}")));
                    return ControlFlow::Break(());
                }
            };
            let (emit, stopped) = out.push(&piece);
            if !send(&emit, &mut text) {
                gone = true;
                return ControlFlow::Break(());
            }
            if stopped {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        };
        let grammar_param = job.request.grammar.as_ref().map(|g| g.param);
        let mut matcher = job.request.grammar.take().map(|g| g.matcher);
        let decoding = Decoding {
            constraint: matcher
                .as_mut()
                .map(|m| m as &mut dyn libvoom::constrain::TokenConstraint),
            drafter: drafter.as_deref_mut().map(|d| d as &mut dyn Drafter),
        };
        let g = engine
            .generate_with(&job.request.prompt_ids, &params, decoding, &mut on_token)
            .map_err(|e| ApiError::engine(&job.request.meta.id, &e, grammar_param))?;
        if let Some(e) = failure {
            return Err(e);
        }
        if gone {
            // The work was done even though nobody reads it: count it.
            self.metrics.record_generation(&g);
            self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            return Ok(None);
        }
        let mut finish = match &out.stopped {
            Some(s) => Finish::StopSequence(s.clone()),
            None => {
                let rest = dec
                    .finish()
                    .map_err(|e| ApiError::internal(format!("detokenizing: {e}")))?;
                let (emit, _) = out.push(&rest);
                let tail = if out.stopped.is_some() {
                    emit
                } else {
                    emit + &out.flush()
                };
                if !send(&tail, &mut text) {
                    self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    return Ok(None);
                }
                match (&out.stopped, g.finish) {
                    (Some(s), _) => Finish::StopSequence(s.clone()),
                    // A grammar's output is complete: as final as an end of sequence.
                    (None, FinishReason::Eos | FinishReason::Complete) => Finish::Eos,
                    (None, _) => Finish::Length,
                }
            }
        };
        let mut tool_calls = Vec::new();
        let mut streamed_calls = 0;
        if let Some(tp) = &job.request.tools {
            let raw = std::mem::take(&mut text);
            let parsed = tp.parse(&raw);
            if tp.forced
                && finish == Finish::Eos
                && (parsed.calls.is_empty() || !parsed.rejected.is_empty())
                && !parsed.unrepresentable
            {
                // The grammar admits only well-formed calls with valid arguments.
                return Err(ApiError::internal(format!(
                    "the forced tool call output did not parse ({}): {raw:?}",
                    parsed.rejected.join("; ")
                )));
            }
            if !parsed.rejected.is_empty() {
                tracing::debug!("tool calls left as text: {}", parsed.rejected.join("; "));
            }
            tool_calls = parsed.calls;
            if let Some(cs) = &calls {
                streamed_calls =
                    adopt_streamed(cs, &call_ids, &mut tool_calls, finish == Finish::Eos).or_else(
                        |e| {
                            if parsed.unrepresentable {
                                Ok(0)
                            } else {
                                Err(e)
                            }
                        },
                    )?;
            }
            // What was streamed is text before the first call; the rest of the content
            // follows it. Forced calls stream as calls: the output is only calls, and
            // what is left (a call cut by the token limit) is not text.
            let streamed = gate.as_ref().map_or(0, |g| g.streamed);
            let sent = raw.get(..streamed).unwrap_or(&raw);
            let rest = if streamed_calls > 0 {
                String::new()
            } else {
                text_after(sent, &parsed.content).ok_or_else(|| {
                    ApiError::internal("tool-call parsing changed text that was already streamed")
                })?
            };
            text = format!("{sent}{rest}");
            if !rest.is_empty() && job.events.send(Event::Text(rest)).is_err() {
                self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                return Ok(None);
            }
            if !tool_calls.is_empty() && finish == Finish::Eos {
                finish = Finish::ToolCalls;
            }
        }
        if let Some(validator) = &job.request.json_schema {
            // Complete JSON output (not cut by a limit or a stop sequence, not calls)
            // must satisfy the schema the grammar enforced.
            if finish == Finish::Eos {
                match serde_json::from_str::<Value>(&text) {
                    Ok(v) => validator.validate(&v).map_err(|e| {
                        ApiError::internal(format!("the constrained output {e}: {text:?}"))
                    })?,
                    // Valid JSON whose number overflows an f64 (`1e400`): serde_json
                    // cannot hold it, so it cannot be checked; the grammar admitted it.
                    Err(e) if is_number_overflow(&e) => {
                        tracing::warn!("JSON output not validated: a number beyond f64 ({e})")
                    }
                    Err(e) => {
                        return Err(ApiError::internal(format!(
                            "the constrained output is not JSON ({e}): {text:?}"
                        )))
                    }
                }
            }
        }
        self.metrics.record_generation(&g);
        tracing::info!(
            "generated: model {} prompt {} tokens, completion {} tokens ({:?}); queue {:.3}s prefill {:.3}s decode {:.3}s ({:.1} tok/s)",
            job.request.meta.id,
            g.prompt_tokens,
            g.ids.len(),
            finish,
            queue_secs,
            g.prefill_secs,
            g.decode_secs,
            g.decode_tokens_per_sec()
        );
        Ok(Some(Outcome {
            finish,
            prompt_tokens: g.prompt_tokens,
            completion_tokens: g.ids.len(),
            text,
            tool_calls,
            streamed_calls,
            queue_secs,
            prefill_secs: g.prefill_secs,
            decode_secs: g.decode_secs,
            decode_passes: g.decode_passes,
            speculation: g.speculation,
        }))
    }
}
