//! One generation as a state machine: the tokens its next pass computes, and what it
//! does with that pass's logits (pick ids as plain decoding would, keep a drafter's
//! proposals while they match, stop). [`Engine::generate_with`] drives one;
//! [`Engine::step`] drives several in one sweep of the weights (continuous
//! batching): each sequence's ids and logits bits are the ones it gets alone, since
//! a position's logits do not depend on the other positions of its pass.

use std::collections::VecDeque;
use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use super::{ConstrainScratch, Decoding, Engine, FinishReason, GenerateParams, Generation};
use crate::constrain::TokenConstraint;
use crate::kv::KvCache;
use crate::model::{Logits, SeqPass};
use crate::sampler::Sampler;
use crate::speculate::{Adaptive, Drafter, SpecReport};
use crate::VoomError;

/// What a sequence's next pass computes.
enum State {
    /// The prompt, from this position on (chunks of it per pass in a batch).
    Prompt {
        done: usize,
    },
    /// The last picked id and the proposals after it (with the distributions they
    /// were drawn from, under speculative sampling).
    Tokens(Vec<u32>, Vec<Vec<(u32, f64)>>),
    Done,
}

/// A proposal a pass computed: its id, the logits that follow it, and the
/// distribution it was drawn from (speculative sampling).
type Ahead = (u32, Vec<f32>, Option<Vec<(u32, f64)>>);

/// One generation in progress: its KV cache, sampler, constraint and drafter, and
/// the ids so far.
pub struct Sequence<'a> {
    prompt: Vec<u32>,
    params: GenerateParams,
    constraint: Option<Box<dyn TokenConstraint + 'a>>,
    drafter: Option<Box<dyn Drafter + 'a>>,
    kv: KvCache,
    sampler: Sampler,
    scratch: ConstrainScratch,
    out: Generation,
    state: State,
    /// The prompt and the ids so far (what the drafter sees).
    context: Vec<u32>,
    /// The logits the next id is picked from.
    logits: Vec<f32>,
    /// Proposals the last pass computed beyond the last picked id, each with the
    /// logits that follow it; their positions are in `kv`.
    ahead: VecDeque<Ahead>,
    /// Of the last pass's proposals, those compared with a picked id and those kept.
    compared: usize,
    kept: usize,
    adapt: Adaptive,
    /// The model's hidden states of positions `hidden_from..`, computed for a
    /// drafter that reads them and not yet handed to it.
    hidden: Vec<f32>,
    hidden_from: usize,
    started: Instant,
    /// The backend's multiply-adds when it started ([`Engine::backend_multiply_adds`]).
    macs_at_start: u64,
    decode_started: Option<Instant>,
    waited_prefill: Duration,
    waited_decode: Duration,
    /// Why it stopped, when that was an error (its constraint or drafter failed).
    error: Option<VoomError>,
    /// The prompt's last position gets a pass of its own: a recurrent state (a
    /// hybrid's) can be cut back only to where a pass started, and a prompt kept for
    /// reuse is asked again with that position to compute (an exact repeat).
    last_alone: bool,
}

impl<'a> Sequence<'a> {
    /// A new sequence of `engine`, checked as a generation is; finished at once when
    /// nothing may be generated.
    pub(super) fn new(
        engine: &Engine,
        prompt: &[u32],
        params: &GenerateParams,
        constraint: Option<Box<dyn TokenConstraint + 'a>>,
        drafter: Option<Box<dyn Drafter + 'a>>,
    ) -> Result<Self, VoomError> {
        // Speculation verifies drafts beside the next position: exact only where a
        // position's bits do not depend on the rows computed with it.
        let drafter = drafter.filter(|_| engine.batch_invariant());
        if prompt.is_empty() {
            return Err(VoomError::Request("the prompt is empty".into()));
        }
        params.sampling.validate().map_err(VoomError::Request)?;
        if prompt.len() >= engine.max_context() {
            return Err(VoomError::Request(format!(
                "the prompt has {} tokens; the context limit is {}",
                prompt.len(),
                engine.max_context()
            )));
        }
        let out = Generation {
            ids: Vec::new(),
            finish: FinishReason::Length,
            prompt_tokens: prompt.len(),
            prefill_secs: 0.0,
            decode_secs: 0.0,
            logits: Vec::new(),
            constraint_secs: 0.0,
            pages: None,
            decode_pages: None,
            prefill_page_wait_secs: 0.0,
            decode_page_wait_secs: 0.0,
            decode_passes: 0,
            prefix_reused: 0,
            prefill_multiply_adds: 0,
            backend: engine.backend_name(),
            exactness_note: engine.exactness_note(),
            speculation: drafter.as_ref().map(|d| SpecReport {
                drafter: d.name(),
                scheme: "exact".into(),
                ..SpecReport::default()
            }),
        };
        let mut s = Sequence {
            prompt: prompt.to_vec(),
            params: params.clone(),
            constraint,
            drafter,
            kv: engine.new_kv(),
            sampler: Sampler::new(params.sampling.clone()),
            scratch: ConstrainScratch::default(),
            out,
            state: State::Prompt { done: 0 },
            context: prompt.to_vec(),
            logits: Vec::new(),
            ahead: VecDeque::new(),
            compared: 0,
            kept: 0,
            adapt: Adaptive::new(params.max_draft),
            hidden: Vec::new(),
            hidden_from: 0,
            started: Instant::now(),
            macs_at_start: engine.backend_multiply_adds(),
            decode_started: None,
            waited_prefill: Duration::ZERO,
            waited_decode: Duration::ZERO,
            error: None,
            last_alone: false,
        };
        s.last_alone = s.kv.has_states() && engine.keeps_prefixes();
        if params.max_new_tokens == 0 {
            s.state = State::Done;
        } else if s.constraint.as_deref().is_some_and(|c| c.is_complete()) {
            // Nothing may be generated: no need to compute the prompt.
            s.out.finish = FinishReason::Complete;
            s.state = State::Done;
        } else if !s.drafter.as_deref().is_some_and(|d| d.wants_hidden()) {
            // The longest prefix computed before: its positions are a cold run's.
            // (A drafter that reads hidden states needs every position's: it
            // computes the whole prompt.)
            if let Some(kv) = engine.take_prefix(prompt) {
                s.out.prefix_reused = kv.len();
                s.state = State::Prompt { done: kv.len() };
                s.kv = kv;
            }
        }
        Ok(s)
    }

    /// Whether it has stopped (its generation is final).
    pub fn finished(&self) -> bool {
        matches!(self.state, State::Done)
    }

    /// Whether its prompt is still being computed.
    pub fn prefilling(&self) -> bool {
        matches!(self.state, State::Prompt { .. })
    }

    /// The ids generated so far.
    pub fn ids(&self) -> &[u32] {
        &self.out.ids
    }

    /// The error that stopped it, if one did (taken: asked again, `None`).
    pub fn take_error(&mut self) -> Option<VoomError> {
        self.error.take()
    }

    /// Its generation: final once [`Sequence::finished`].
    pub fn into_generation(self) -> Generation {
        self.out
    }

    /// Whether its passes compute the model's hidden states: for a drafter that
    /// reads them, while it may still draft.
    fn wants_hidden(&self) -> bool {
        self.drafter.as_deref().is_some_and(|d| d.wants_hidden()) && self.adapt.stopped().is_none()
    }

    /// Keeps the hidden states a pass computed for positions `start..`.
    fn keep_hidden(&mut self, start: usize, rows: Vec<f32>) {
        if rows.is_empty() {
            return;
        }
        if self.hidden.is_empty() {
            self.hidden_from = start;
            self.hidden = rows;
        } else {
            self.hidden.extend_from_slice(&rows);
        }
    }

    /// The positions its next pass computes: at most `prompt_room` of the prompt
    /// (at least one), or the last id and its proposals. `None` when finished.
    fn next_tokens(&self, prompt_room: usize) -> Option<(std::ops::Range<usize>, Logits)> {
        match &self.state {
            State::Prompt { done } => {
                let n = self.prompt.len();
                let last = if self.last_alone && *done + 1 < n {
                    n - 1
                } else {
                    n
                };
                let end = done.saturating_add(prompt_room.max(1)).min(last);
                Some((*done..end, Logits::Last))
            }
            State::Tokens(t, _) => Some((
                0..t.len(),
                if t.len() > 1 {
                    Logits::All
                } else {
                    Logits::Last
                },
            )),
            State::Done => None,
        }
    }

    /// Takes its pass's logits (`rows`: a row per position `want` asked for), which
    /// took `secs` and waited `waited` for pages: picks ids while the pass's rows
    /// cover them, calling `on_token` with each, and prepares the next pass.
    fn absorb(
        &mut self,
        engine: &Engine,
        positions: usize,
        rows: Vec<f32>,
        secs: f64,
        waited: Duration,
        on_token: &mut dyn FnMut(u32) -> ControlFlow<()>,
    ) -> Result<(), VoomError> {
        let v = engine.config().vocab_size;
        match std::mem::replace(&mut self.state, State::Done) {
            State::Prompt { done } => {
                self.waited_prefill += waited;
                let done = done + positions;
                if done < self.prompt.len() {
                    self.state = State::Prompt { done };
                    return Ok(());
                }
                self.out.prefill_secs = self.started.elapsed().as_secs_f64();
                self.out.prefill_multiply_adds =
                    engine.backend_multiply_adds() - self.macs_at_start;
                self.out.prefill_page_wait_secs = self.waited_prefill.as_secs_f64();
                engine.keep_prefix(&self.prompt, &self.kv, true);
                self.decode_started = Some(Instant::now());
                self.logits = rows;
            }
            State::Tokens(tokens, qs) => {
                self.waited_decode += waited;
                self.adapt.observe_pass(tokens.len(), secs);
                self.out.decode_passes += 1;
                let mut rows = rows.chunks_exact(v).map(<[f32]>::to_vec);
                self.logits = rows.next().expect("a pass returns a row per position");
                let mut qs = qs.into_iter();
                for (&t, row) in tokens[1..].iter().zip(rows) {
                    self.ahead.push_back((t, row, qs.next()));
                }
                if let Some(r) = self.out.speculation.as_mut() {
                    r.passes += 1;
                    r.verify_passes += usize::from(tokens.len() > 1);
                    if let Some(why) = self.adapt.stopped() {
                        r.stopped.get_or_insert_with(|| why.to_string());
                    }
                }
            }
            State::Done => unreachable!("a finished sequence has no pass"),
        }
        self.pick(engine, on_token)
    }

    /// Picks ids from the logits at hand, as plain decoding would, until one needs a
    /// pass of its own (then `state` holds it, with any proposals) or the sequence
    /// stops.
    fn pick(
        &mut self,
        engine: &Engine,
        on_token: &mut dyn FnMut(u32) -> ControlFlow<()>,
    ) -> Result<(), VoomError> {
        loop {
            let step = self.out.ids.len();
            let id = match self.constraint.as_deref_mut() {
                None => match self.ahead.front() {
                    // Speculative sampling: a proposal drawn from the draft's q.
                    Some((proposed, _, Some(q))) => self.sampler.verify(&self.logits, *proposed, q),
                    _ => self.sampler.sample(&self.logits),
                },
                Some(c) => {
                    let tc = Instant::now();
                    let id = engine.pick_constrained(
                        c,
                        step,
                        &self.logits,
                        &mut self.sampler,
                        &mut self.scratch,
                    )?;
                    self.out.constraint_secs += tc.elapsed().as_secs_f64();
                    id
                }
            };
            if self.params.record_logits {
                self.out.logits.push(std::mem::take(&mut self.logits));
            }
            self.out.ids.push(id);
            self.context.push(id);
            // A proposal computed for this step is kept when it is the id picked,
            // and the logits after it are the next step's; otherwise it and every
            // one after it leave the cache.
            let mut have_next = false;
            if let Some((proposed, _, _)) = self.ahead.front() {
                self.compared += 1;
                if *proposed == id {
                    self.kept += 1;
                    self.logits = self.ahead.pop_front().expect("a front").1;
                    have_next = true;
                } else {
                    let cut = self.kv.len() - self.ahead.len();
                    self.kv.truncate(cut);
                    self.ahead.clear();
                }
                if self.ahead.is_empty() {
                    self.close_verification();
                }
            }
            let mut complete = false;
            if let Some(c) = self.constraint.as_deref_mut() {
                // An end-of-sequence id is the engine's, never passed to the constraint.
                if !engine.eos.contains(&id) {
                    let tc = Instant::now();
                    c.accept(step, id)?;
                    complete = c.is_complete();
                    self.out.constraint_secs += tc.elapsed().as_secs_f64();
                }
            }
            // The positions plain decoding would have computed by now: the prompt
            // and every id but this one.
            let computed = self.prompt.len() + self.out.ids.len() - 1;
            let params = &self.params;
            let stop = if on_token(id).is_break() {
                Some(FinishReason::Stopped)
            } else if (!params.ignore_eos || self.constraint.is_some()) && engine.eos.contains(&id)
            {
                Some(FinishReason::Eos)
            } else if complete {
                Some(FinishReason::Complete)
            } else if self.out.ids.len() >= params.max_new_tokens {
                Some(FinishReason::Length)
            } else if computed + 1 > self.kv.capacity() {
                Some(FinishReason::ContextFull)
            } else {
                None
            };
            if let Some(finish) = stop {
                self.out.finish = finish;
                // The cache holds what plain decoding's would: nothing proposed.
                if self.compared > 0 {
                    self.close_verification();
                }
                let keep = self.kv.len().min(computed);
                self.kv.truncate(keep);
                // The conversation so far, for a next turn that extends it.
                engine.keep_prefix(&self.context[..keep], &self.kv, false);
                self.finish();
                return Ok(());
            }
            if have_next {
                continue;
            }
            // The next pass computes `id` and, with a drafter, the proposals after
            // it: at most the ids still wanted after this one, and the context's room.
            let room =
                (params.max_new_tokens - self.out.ids.len()).min(self.kv.capacity() - computed - 1);
            let mut tokens = vec![id];
            let mut qs = Vec::new();
            if let Some(d) = self.drafter.as_deref_mut() {
                // The hidden states of the positions kept (the cache's), once each.
                if !self.hidden.is_empty() {
                    let h = engine.config().hidden_size;
                    let kept = self.kv.len().saturating_sub(self.hidden_from);
                    let rows = kept.min(self.hidden.len() / h);
                    d.observe_hidden(self.hidden_from, &self.hidden[..rows * h]);
                    self.hidden.clear();
                    self.hidden_from = self.kv.len();
                }
                let k = if params.adaptive_draft {
                    self.adapt.next_k(room)
                } else {
                    room.min(params.max_draft)
                };
                if k > 0 {
                    let td = Instant::now();
                    let sampled = if params.speculative_sampling
                        && !params.sampling.is_greedy()
                        && self.constraint.is_none()
                    {
                        d.propose_sampled(&self.context, k, &params.sampling)?
                    } else {
                        None
                    };
                    let p: Vec<u32> = match sampled {
                        Some(s) => {
                            if let Some(r) = self.out.speculation.as_mut() {
                                r.scheme = "speculative-sampling".into();
                            }
                            let (ids, q): (Vec<u32>, Vec<_>) = s.into_iter().unzip();
                            qs = q;
                            ids
                        }
                        None => d.propose(&self.context, k)?,
                    };
                    // At most k, and none past the vocabulary.
                    let vocab = engine.config().vocab_size;
                    let valid = p.iter().take(k).take_while(|&&t| (t as usize) < vocab);
                    tokens.extend(valid);
                    qs.truncate(tokens.len() - 1);
                    self.adapt
                        .observe_draft(tokens.len() - 1, td.elapsed().as_secs_f64());
                }
            }
            self.state = State::Tokens(tokens, qs);
            return Ok(());
        }
    }

    /// Counts the last pass's compared and kept proposals.
    fn close_verification(&mut self) {
        self.adapt.observe_verify(self.compared, self.kept);
        if let Some(r) = self.out.speculation.as_mut() {
            r.drafted += self.compared;
            r.accepted += self.kept;
        }
        (self.compared, self.kept) = (0, 0);
    }

    /// Stops: the timings are final.
    fn finish(&mut self) {
        self.state = State::Done;
        if let Some(t) = self.decode_started {
            self.out.decode_secs = t.elapsed().as_secs_f64();
        }
        self.out.decode_page_wait_secs = self.waited_decode.as_secs_f64();
    }
}

impl Engine {
    /// A generation to drive with [`Engine::step`], beside others: the same checks,
    /// ids and logits bits as [`Engine::generate_with`] with the same arguments.
    pub fn sequence<'a>(
        &self,
        prompt: &[u32],
        params: &GenerateParams,
        decoding: Decoding<'a>,
    ) -> Result<Sequence<'a>, VoomError> {
        let Decoding {
            constraint,
            drafter,
        } = decoding;
        Sequence::new(
            self,
            prompt,
            params,
            constraint.map(|c| Box::new(c) as Box<dyn TokenConstraint + 'a>),
            drafter.map(|d| Box::new(d) as Box<dyn Drafter + 'a>),
        )
    }

    /// [`Engine::sequence`] owning its constraint and drafter (a server keeps them
    /// with the sequence).
    pub fn sequence_owned<'a>(
        &self,
        prompt: &[u32],
        params: &GenerateParams,
        constraint: Option<Box<dyn TokenConstraint + 'a>>,
        drafter: Option<Box<dyn Drafter + 'a>>,
    ) -> Result<Sequence<'a>, VoomError> {
        Sequence::new(self, prompt, params, constraint, drafter)
    }

    /// One pass over every unfinished sequence of `seqs`, in one sweep of the
    /// weights: each decoding sequence's last id and proposals, and at most
    /// `prompt_room` positions of prompts (shared in order among the sequences still
    /// prefilling; one at least where no sequence decodes). Then each sequence picks
    /// its ids, `on_token(i, id)` hearing each (`i`: its index in `seqs`; `Break`
    /// stops that sequence). Each sequence's ids and logits are those it gets alone.
    /// On `Err` (the pass failed) every sequence's state is as it was; a sequence
    /// whose own constraint or drafter fails stops with that error
    /// ([`Sequence::take_error`]) and the others go on.
    pub fn step(
        &self,
        seqs: &mut [&mut Sequence<'_>],
        prompt_room: usize,
        on_token: &mut dyn FnMut(usize, u32) -> ControlFlow<()>,
    ) -> Result<(), VoomError> {
        let decoding = seqs.iter().any(|s| matches!(s.state, State::Tokens(..)));
        // A backend that is not batch invariant computes one sequence a pass, its
        // whole prompt at once: batched, or split, its bits could change.
        let alone = !self.batch_invariant();
        let mut room = if alone {
            usize::MAX
        } else if decoding {
            prompt_room
        } else {
            prompt_room.max(1)
        };
        // (sequence index, its positions' range, want)
        let mut plan = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            if alone && !plan.is_empty() {
                break;
            }
            let share = if s.prefilling() { room } else { usize::MAX };
            if s.prefilling() && share == 0 {
                continue;
            }
            if let Some((range, want)) = s.next_tokens(share) {
                if s.prefilling() {
                    room -= range.len().min(room);
                }
                plan.push((i, range, want));
            }
        }
        if plan.is_empty() {
            return Ok(());
        }
        let tokens: Vec<Vec<u32>> = plan
            .iter()
            .map(|(i, r, _)| match &seqs[*i].state {
                State::Prompt { .. } => seqs[*i].prompt[r.clone()].to_vec(),
                State::Tokens(t, _) => t.clone(),
                State::Done => unreachable!("planned sequences are unfinished"),
            })
            .collect();
        let t0 = Instant::now();
        let mut waited = Duration::ZERO;
        // Where each planned sequence's pass starts, and its hidden states (for a
        // drafter that reads them).
        let starts: Vec<usize> = plan.iter().map(|(i, _, _)| seqs[*i].kv.len()).collect();
        let mut hidden: Vec<Option<Vec<f32>>> = plan
            .iter()
            .map(|(i, _, _)| seqs[*i].wants_hidden().then(Vec::new))
            .collect();
        let rows = {
            // Each planned sequence's KV cache, in plan order.
            let mut kvs: Vec<Option<&mut KvCache>> =
                seqs.iter_mut().map(|s| Some(&mut s.kv)).collect();
            let mut passes: Vec<SeqPass<'_>> = plan
                .iter()
                .zip(&tokens)
                .zip(hidden.iter_mut())
                .map(|(((i, _, want), t), h)| SeqPass {
                    hidden_out: h.as_mut(),
                    ..SeqPass::new(
                        t,
                        kvs[*i].take().expect("a sequence is planned once"),
                        *want,
                    )
                })
                .collect();
            self.forward_batch_timed(&mut passes, &mut waited)?
        };
        let secs = t0.elapsed().as_secs_f64();
        for ((((i, range, _), rows), start), h) in
            plan.into_iter().zip(rows).zip(starts).zip(hidden)
        {
            let s = &mut *seqs[i];
            if let Some(h) = h {
                s.keep_hidden(start, h);
            }
            if let Err(e) = s.absorb(self, range.len(), rows, secs, waited, &mut |id| {
                on_token(i, id)
            }) {
                // Its constraint or drafter failed: it stops, the others go on.
                s.error = Some(e);
                s.finish();
            }
        }
        Ok(())
    }
}
