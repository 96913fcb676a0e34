//! A sequence's recurrent state: what a hybrid model's linear-attention layers
//! (Gated DeltaNet) carry from one position to the next instead of keys and values.
//! Each such layer holds a fixed-size [`LayerState`] (its causal convolution's last
//! inputs and the delta rule's matrices), whatever the positions.
//!
//! A state cannot be cut back to an earlier position the way keys and values can,
//! so [`States`] keeps three of each layer's:
//!
//! - **now**: as the positions appended so far leave it (a pass's chunks advance it
//!   in order);
//! - **committed**: as of the committed positions ([`States::commit`] copies `now`);
//! - **before**: as of the start of the last committed pass, with that position.
//!
//! Cutting positions off ([`States::cut`]) to the committed length (a failed pass)
//! restores `now`; to a position inside the last committed pass (rejected drafted
//! tokens) restores the state before that pass, and the positions from its start to
//! the cut are to be computed again from their ids (the cache marks them lost: the
//! engine recomputes lost positions before its next pass, with the same bits, since
//! a position's state does not depend on how its prompt was cut into passes); further
//! back, every position is computed again.

/// Floats of one linear-attention layer's state: its convolution's and its matrices'.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateShape {
    pub conv: usize,
    pub matrix: usize,
}

/// One linear-attention layer's state at a position.
#[derive(Debug, PartialEq)]
pub struct LayerState {
    /// The causal convolution's inputs of the positions before (the last
    /// `kernel - 1`, oldest first, each `channels` floats; zeros before position 0).
    pub conv: Vec<f32>,
    /// The delta rule's state matrices (per value head, key dim by value dim).
    pub matrix: Vec<f32>,
}

impl Clone for LayerState {
    fn clone(&self) -> Self {
        LayerState {
            conv: self.conv.clone(),
            matrix: self.matrix.clone(),
        }
    }

    /// Into the buffers it has (a commit copies states every pass).
    fn clone_from(&mut self, source: &Self) {
        self.conv.clone_from(&source.conv);
        self.matrix.clone_from(&source.matrix);
    }
}

impl LayerState {
    fn zeros(shape: StateShape) -> Self {
        LayerState {
            conv: vec![0.0; shape.conv],
            matrix: vec![0.0; shape.matrix],
        }
    }

    fn floats(&self) -> usize {
        self.conv.len() + self.matrix.len()
    }

    fn reset(&mut self) {
        self.conv.fill(0.0);
        self.matrix.fill(0.0);
    }
}

/// The recurrent states of one sequence, by model layer (`None`: a layer of keys
/// and values).
#[derive(Debug, Clone, Default)]
pub struct States {
    now: Vec<Option<LayerState>>,
    committed: Vec<Option<LayerState>>,
    /// The state at the start of the last committed pass, and that position.
    before: Option<(usize, Vec<Option<LayerState>>)>,
}

impl States {
    /// Zero states (position 0) for the layers `shapes` gives one.
    pub fn new(shapes: &[Option<StateShape>]) -> Self {
        let zeros: Vec<Option<LayerState>> =
            shapes.iter().map(|s| s.map(LayerState::zeros)).collect();
        States {
            now: zeros.clone(),
            committed: zeros,
            before: None,
        }
    }

    /// Whether any layer has a state.
    pub fn is_empty(&self) -> bool {
        self.now.iter().all(Option::is_none)
    }

    /// Layer `layer`'s state as the positions appended so far leave it (`None`: a
    /// layer without one).
    pub fn layer(&self, layer: usize) -> Option<&LayerState> {
        self.now.get(layer).and_then(Option::as_ref)
    }

    /// [`States::layer`], to advance.
    pub fn layer_mut(&mut self, layer: usize) -> Option<&mut LayerState> {
        self.now.get_mut(layer).and_then(Option::as_mut)
    }

    /// Bytes of one copy of every layer's state (what a sequence's state adds per
    /// copy; three are kept).
    pub fn bytes(&self) -> usize {
        self.now
            .iter()
            .flatten()
            .map(LayerState::floats)
            .sum::<usize>()
            * 4
    }

    /// Floats of one copy of every layer's state.
    pub fn floats(&self) -> usize {
        self.now.iter().flatten().map(LayerState::floats).sum()
    }

    /// The committed state, flat (each layer's convolution then matrices, in layer
    /// order), and the state where the last committed pass started, with that
    /// position.
    pub fn export(&self) -> (Vec<f32>, Option<(usize, Vec<f32>)>) {
        let flat = |layers: &[Option<LayerState>]| {
            let mut v = Vec::with_capacity(self.floats());
            for s in layers.iter().flatten() {
                v.extend_from_slice(&s.conv);
                v.extend_from_slice(&s.matrix);
            }
            v
        };
        (
            flat(&self.committed),
            self.before.as_ref().map(|(at, b)| (*at, flat(b))),
        )
    }

    /// The position the last committed pass started at, where its state is kept.
    pub fn before_at(&self) -> Option<usize> {
        self.before.as_ref().map(|(at, _)| *at)
    }

    /// Sets the committed state (and the appended positions': none) from `flat`, as
    /// [`States::export`] gives it, and the one before the last pass.
    pub fn import(&mut self, flat: &[f32], before: Option<(usize, &[f32])>) -> Result<(), String> {
        fn fill(layers: &mut [Option<LayerState>], mut flat: &[f32]) -> Result<(), String> {
            for s in layers.iter_mut().flatten() {
                let (c, rest) = flat
                    .split_at_checked(s.conv.len())
                    .ok_or("a recurrent state shorter than its layers")?;
                s.conv.copy_from_slice(c);
                let (m, rest) = rest
                    .split_at_checked(s.matrix.len())
                    .ok_or("a recurrent state shorter than its layers")?;
                s.matrix.copy_from_slice(m);
                flat = rest;
            }
            if flat.is_empty() {
                Ok(())
            } else {
                Err("a recurrent state longer than its layers".into())
            }
        }
        fill(&mut self.committed, flat)?;
        self.now.clone_from(&self.committed);
        self.before = match before {
            Some((at, b)) => {
                let mut layers = self.committed.clone();
                fill(&mut layers, b)?;
                Some((at, layers))
            }
            None => None,
        };
        Ok(())
    }

    /// The appended positions are committed: `len` is the committed length before
    /// them. Copies `now` into the buffers of the oldest state (no allocation once
    /// three exist).
    pub fn commit(&mut self, len: usize) {
        if self.is_empty() {
            return;
        }
        let mut previous = match self.before.take() {
            Some((_, oldest)) => oldest,
            None => self.committed.clone(),
        };
        std::mem::swap(&mut previous, &mut self.committed);
        self.committed.clone_from(&self.now);
        self.before = Some((len, previous));
    }

    /// The last position at or before `at` (of `committed` committed) that the state
    /// can be cut back to without computing anything before `at` twice over: `at`
    /// itself among appended positions or at the last pass's start; that start where
    /// `at` is inside the last pass; else 0.
    pub fn resumable(&self, at: usize, committed: usize) -> usize {
        if self.is_empty() || at >= committed {
            return at;
        }
        match &self.before {
            Some((start, _)) if *start <= at => *start,
            _ => 0,
        }
    }

    /// Cuts the state back to `len` positions, of `committed` committed: returns the
    /// first position to compute again from its id (`Some(0)`: all of them), or
    /// `None` when the state is as of `len` now.
    pub fn cut(&mut self, len: usize, committed: usize) -> Option<usize> {
        if self.is_empty() {
            return None;
        }
        if len >= committed {
            // Only appended positions go: the committed state stands.
            self.now.clone_from(&self.committed);
            return None;
        }
        match &self.before {
            Some((start, state)) if *start <= len => {
                let start = *start;
                self.committed.clone_from(state);
                self.now.clone_from(state);
                (start < len).then_some(start)
            }
            _ => {
                for s in self.now.iter_mut().chain(&mut self.committed).flatten() {
                    s.reset();
                }
                self.before = None;
                (len > 0).then_some(0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: StateShape = StateShape { conv: 3, matrix: 4 };

    /// A state advanced by `x` (a stand-in for a pass's positions).
    fn advance(s: &mut States, x: f32) {
        let l = s.layer_mut(1).unwrap();
        l.conv.iter_mut().for_each(|v| *v += x);
        l.matrix.iter_mut().for_each(|v| *v = *v * 0.5 + x);
    }

    fn states() -> States {
        States::new(&[None, Some(SHAPE), None])
    }

    #[test]
    fn only_layers_with_a_shape_have_a_state() {
        let s = states();
        assert!(s.layer(0).is_none() && s.layer(2).is_none());
        assert_eq!(s.layer(1).unwrap().conv, vec![0.0; 3]);
        assert_eq!(s.bytes(), 7 * 4);
        assert!(States::new(&[None, None]).is_empty());
    }

    #[test]
    fn a_failed_pass_leaves_the_committed_state() {
        let mut s = states();
        advance(&mut s, 1.0);
        s.commit(0);
        let committed = s.layer(1).unwrap().clone();
        advance(&mut s, 2.0);
        assert_eq!(s.cut(5, 5), None);
        assert_eq!(s.layer(1).unwrap(), &committed);
    }

    #[test]
    fn a_cut_inside_the_last_pass_restores_its_start_and_asks_for_the_rest() {
        let mut s = states();
        advance(&mut s, 1.0);
        s.commit(0); // positions 0..4
        let at4 = s.layer(1).unwrap().clone();
        advance(&mut s, 2.0);
        s.commit(4); // positions 4..9
                     // Keep 6 of the 9: the state at 4, and positions 4..6 computed again.
        assert_eq!(s.cut(6, 9), Some(4));
        assert_eq!(s.layer(1).unwrap(), &at4);
        // Cut exactly at the pass's start: nothing to compute again.
        let mut t = states();
        advance(&mut t, 1.0);
        t.commit(0);
        advance(&mut t, 2.0);
        t.commit(4);
        assert_eq!(t.cut(4, 9), None);
        assert_eq!(t.layer(1).unwrap(), &at4);
    }

    #[test]
    fn a_cut_before_the_last_pass_starts_over() {
        let mut s = states();
        advance(&mut s, 1.0);
        s.commit(0);
        advance(&mut s, 2.0);
        s.commit(4);
        assert_eq!(s.cut(2, 9), Some(0));
        assert_eq!(s.layer(1).unwrap(), &LayerState::zeros(SHAPE));
        // And to nothing: nothing to compute.
        let mut t = states();
        advance(&mut t, 1.0);
        t.commit(0);
        assert_eq!(t.cut(0, 4), None);
        assert_eq!(t.layer(1).unwrap(), &LayerState::zeros(SHAPE));
    }

    #[test]
    fn a_state_exported_and_imported_is_the_same_state() {
        let mut s = states();
        advance(&mut s, 1.0);
        s.commit(0);
        advance(&mut s, 2.0);
        s.commit(4);
        let (now, before) = s.export();
        assert_eq!(now.len(), s.floats());
        let mut t = states();
        t.import(&now, before.as_ref().map(|(at, b)| (*at, b.as_slice())))
            .unwrap();
        assert_eq!(t.layer(1), s.layer(1));
        // It cuts back as the original does.
        assert_eq!(t.cut(5, 9), s.cut(5, 9));
        assert_eq!(t.layer(1), s.layer(1));
        assert!(states().import(&now[1..], None).is_err());
        assert!(states()
            .import(&[now.clone(), vec![0.0]].concat(), None)
            .is_err());
    }

    #[test]
    fn a_cache_without_states_has_nothing_to_cut() {
        let mut s = States::new(&[None]);
        s.commit(0);
        assert_eq!(s.cut(0, 3), None);
    }
}
