//! The engine worker: one engine resident at a time, on a thread of its own. It
//! batches: the requests for the resident model run together, at most `max_batch`
//! at once, each step computing every one's next positions in one sweep of the
//! weights (`Engine::step`: a decoding request's last id and any proposals, and up
//! to `prefill_room` prompt positions of the requests still prefilling). A request
//! joins and leaves between steps, in arrival order (a FIFO queue: fair, and a
//! queued request waits rather than fails). Each request's ids and logits bits are
//! the ones it gets alone. A request for another model waits until the batch
//! drains, then swaps the engine; the requests behind it wait for it.
//!
//! A request's output goes back over a channel as text pieces, already cut at its
//! stop sequences ([`super::output`]). When the client goes away its receiver is
//! dropped: its next id notices, its sequence stops and its slot frees at once,
//! the others going on; a request whose client left while it was queued is skipped.

use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use libvoom::constrain::TokenConstraint;
use libvoom::engine::{Engine, Sequence};
use tokio::sync::mpsc::UnboundedSender;
use vpaged::PageSource;

use super::catalog::ModelMeta;
use super::error::{ApiError, Kind};
use super::job::{Event, Job};
use super::metrics::Metrics;
use super::output::{Ended, Output};
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
        batching: Batching,
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
            batching,
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
    batching: Batching,
}

/// How many requests share a sweep, and how many prompt positions a sweep computes
/// beside the decode steps.
#[derive(Debug, Clone, Copy)]
pub struct Batching {
    pub max_batch: usize,
    pub prefill_room: usize,
}

impl WorkerState {
    fn run(mut self, rx: mpsc::Receiver<Job>) {
        let mut next: Option<Job> = None;
        loop {
            let job = match next.take() {
                Some(j) if j.events.is_closed() => {
                    self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Some(j) => j,
                None => match self.next_job(&rx, true) {
                    Some(j) => j,
                    None => break,
                },
            };
            if let Err(e) = self.engine_for(&job.request.meta) {
                let _ = job.events.send(Event::Failed(e));
                continue;
            }
            let engine = self.engine.take().expect("loaded above");
            let speculation = std::mem::replace(&mut self.speculation, Speculation::Off);
            // The senders of the requests in the batch, so that a panic still answers
            // each of them.
            let mut live: Vec<UnboundedSender<Event>> = Vec::new();
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.batch(&engine, &speculation, job, &rx, &mut live)
            }));
            self.metrics.busy.store(0, Ordering::Relaxed);
            match r {
                Ok(other) => {
                    next = other;
                    self.engine = Some(engine);
                    self.speculation = speculation;
                }
                Err(panic) => {
                    let what = panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    tracing::error!("the engine panicked: {what}");
                    // The engine's state is unknown after a panic: load it afresh.
                    drop(engine);
                    *self.resident.lock().unwrap_or_else(|e| e.into_inner()) = None;
                    for tx in live {
                        let _ = tx.send(Event::Failed(ApiError::internal(format!(
                            "the engine failed: {what}"
                        ))));
                    }
                }
            }
        }
    }

    /// Runs `first` and every request for the same model that arrives while the
    /// batch runs (at most `max_batch` at once), one sweep of the weights per step
    /// for all of them, until none is left. Returns a request for another model that
    /// arrived meanwhile: requests after it wait for it (arrival order is kept).
    fn batch(
        &self,
        engine: &Engine,
        speculation: &Speculation,
        first: Job,
        rx: &mpsc::Receiver<Job>,
        live: &mut Vec<UnboundedSender<Event>>,
    ) -> Option<Job> {
        let model = first.request.meta.dir.clone();
        // The KV cache the memory planner reserved is the engine's context: the
        // positions a request can reach (its prompt and max_tokens) are reserved when
        // it joins, and a request that does not fit beside those running waits
        // (arrival order kept) until enough of them end.
        let context = engine.max_context();
        let reach = |job: &Job| {
            (job.request.prompt_ids.len() + job.request.params.max_new_tokens).min(context)
        };
        let mut reserved = 0usize;
        let mut running: Vec<(Output<'_>, Sequence<'_>)> = Vec::new();
        let mut other: Option<Job> = None;
        let mut first = Some(first);
        loop {
            // Requests join between steps.
            while running.len() < self.batching.max_batch {
                let job = match first.take() {
                    Some(j) => j,
                    None if other.is_some() => break,
                    None => match self.next_job(rx, false) {
                        Some(j) => j,
                        None => break,
                    },
                };
                if job.request.meta.dir != model {
                    other = Some(job);
                    break;
                }
                if !running.is_empty() && reserved + reach(&job) > context {
                    first = Some(job);
                    break;
                }
                let events = job.events.clone();
                let positions = reach(&job);
                match self.admit(engine, speculation, job) {
                    Ok(r) => {
                        live.push(events);
                        reserved += positions;
                        running.push(r);
                    }
                    Err((job, e)) => {
                        let _ = job.events.send(Event::Failed(e));
                    }
                }
            }
            if running.is_empty() {
                return other;
            }
            self.metrics.busy.store(running.len(), Ordering::Relaxed);
            self.metrics
                .batch_peak
                .fetch_max(running.len(), Ordering::Relaxed);
            let (outs, seqs): (Vec<_>, Vec<_>) = running.iter_mut().map(|(o, s)| (o, s)).unzip();
            let mut outs = outs;
            let mut seqs = seqs;
            let stepped = engine.step(&mut seqs, self.batching.prefill_room, &mut |i, id| {
                outs[i].on_token(id)
            });
            if let Err(e) = stepped {
                // The pass failed (the store, a corrupt page): every request in it
                // fails with the error.
                reserved = 0;
                for (o, _) in running.drain(..) {
                    let err = ApiError::engine(&o.job.request.meta.id, &e, o.grammar_param);
                    let _ = o.job.events.send(Event::Failed(err));
                }
                live.clear();
                continue;
            }
            // A request whose client left stops at its next id; finished ones answer.
            let mut i = 0;
            while i < running.len() {
                if !running[i].1.finished() {
                    i += 1;
                    continue;
                }
                let (o, mut s) = running.swap_remove(i);
                reserved -= reach(&o.job);
                live.retain(|tx| !tx.same_channel(&o.job.events));
                let events = o.job.events.clone();
                if let Some(e) = s.take_error() {
                    let err = ApiError::engine(&o.job.request.meta.id, &e, o.grammar_param);
                    let _ = events.send(Event::Failed(err));
                    continue;
                }
                let g = s.into_generation();
                self.metrics.record_generation(&g);
                if let Some(k) = engine.kv_pool_stats() {
                    self.metrics.record_kv(k);
                }
                match o.finish(&g) {
                    Ok(Ended::Done(outcome)) => {
                        let _ = events.send(Event::Done(*outcome));
                    }
                    Ok(Ended::Gone) => {
                        self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        let _ = events.send(Event::Failed(e));
                    }
                }
            }
        }
    }

    /// The next queued request whose client is still there (one whose client left
    /// while it waited is counted cancelled and skipped). `wait`: blocks for one
    /// (`None`: the queue is closed); else only one already queued.
    fn next_job(&self, rx: &mpsc::Receiver<Job>, wait: bool) -> Option<Job> {
        loop {
            let job = if wait {
                rx.recv().ok()?
            } else {
                rx.try_recv().ok()?
            };
            self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
            if !job.events.is_closed() {
                return Some(job);
            }
            self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A request's output side and sequence, ready to join the batch (or, with the
    /// job back, why it cannot run).
    #[allow(clippy::result_large_err)]
    fn admit<'e>(
        &self,
        engine: &'e Engine,
        speculation: &Speculation,
        mut job: Job,
    ) -> Result<(Output<'e>, Sequence<'e>), (Job, ApiError)> {
        let Some(tok) = engine.tokenizer() else {
            let e = ApiError::internal(format!(
                "model '{}' has no tokenizer.json",
                job.request.meta.id
            ));
            return Err((job, e));
        };
        let eos = engine.eos_ids().to_vec();
        if let Some(g) = job.request.grammar.as_ref().filter(|g| g.eos != eos) {
            // The grammar leaves the eos ids to the engine: both must mean the same ids.
            let e = ApiError::internal(format!(
                "the grammar for model '{}' was compiled with end-of-sequence ids {:?}, but the engine stops on {:?}",
                job.request.meta.id, g.eos, eos
            ));
            return Err((job, e));
        }
        // A drafter of its own per request; the draft length as `voom serve` was asked.
        let mut params = job.request.params.clone();
        self.spec.apply(&mut params);
        let grammar = job.request.grammar.take();
        let grammar_param = grammar.as_ref().map(|g| g.param);
        let matcher = grammar.map(|g| Box::new(g.matcher) as Box<dyn TokenConstraint>);
        let drafter = match speculation.drafter(engine) {
            Ok(d) => d,
            Err(e) => {
                let e = ApiError::internal(format!("cannot draft: {e:#}"));
                return Err((job, e));
            }
        };
        let seq = engine.sequence_owned(&job.request.prompt_ids, &params, matcher, drafter);
        match seq {
            Ok(seq) => Ok((Output::new(job, tok, eos, grammar_param), seq)),
            Err(e) => {
                let e = ApiError::engine(&job.request.meta.id, &e, grammar_param);
                Err((job, e))
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
                "loaded model {}{} in {:.2}s ({})",
                meta.id,
                meta.scheme
                    .as_ref()
                    .map_or(String::new(), |s| format!(" (LOSSY: {s} weights)")),
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
}
