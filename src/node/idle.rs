//! Steps with no object left on this task, kept open a while
//! (`Node::step_idle`).
//!
//! TensorFlow's rendezvous cache holds a step's rendezvous weakly. When the
//! last holder drops it, the step may still be running here: an eager
//! function with two components on one task (two devices of the task) runs
//! each as its own call, and if one finishes before the other starts, the
//! second finds a new rendezvous for the same step. Ending the step when
//! the first object goes would drop what peers already pushed for the
//! second, and fail its receives. So the end of an object only marks the
//! step idle. The step ends when TensorFlow cleans it up
//! (`Node::step_done`), or when it has been idle for `IDLE_STEP_LINGER_MS`
//! with no new object (`Node::step_active`), checked by `rdev-keepalive`.
//! At most `IDLE_STEPS_MAX` steps are idle at once: past that, the oldest
//! ends at once.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::constants::IDLE_STEPS_MAX;

pub(super) struct IdleSteps {
    /// Step → when it last went idle.
    since: HashMap<u64, Instant>,
    /// (step, when it went idle), oldest first. An entry whose time is not
    /// the step's in `since` is stale (the step went active, or idle
    /// again later) and is skipped.
    order: VecDeque<(u64, Instant)>,
}

impl Default for IdleSteps {
    fn default() -> Self {
        // Full size from the start: the steady state allocates nothing.
        IdleSteps {
            since: HashMap::with_capacity(IDLE_STEPS_MAX + 1),
            order: VecDeque::with_capacity(2 * IDLE_STEPS_MAX + 2),
        }
    }
}

impl IdleSteps {
    /// `step` has no object left on this task since `now`. Returns a step
    /// to end at once when more than `IDLE_STEPS_MAX` are idle.
    pub(super) fn idle(&mut self, step: u64, now: Instant) -> Option<u64> {
        self.since.insert(step, now);
        if self.order.len() > 2 * IDLE_STEPS_MAX {
            // Mostly stale entries: drop them (in place, no allocation).
            let since = &self.since;
            self.order.retain(|(s, t)| since.get(s) == Some(t));
        }
        self.order.push_back((step, now));
        if self.since.len() > IDLE_STEPS_MAX {
            return self.pop_oldest();
        }
        None
    }

    /// `step` has an object again (or it ended): it is not idle. Whether
    /// it was.
    pub(super) fn active(&mut self, step: u64) -> bool {
        !self.since.is_empty() && self.since.remove(&step).is_some()
    }

    /// The steps idle for `linger` or longer at `now`, oldest first; they
    /// are forgotten here (the caller ends them).
    pub(super) fn expired(&mut self, now: Instant, linger: Duration, out: &mut Vec<u64>) {
        while let Some(&(step, t)) = self.order.front() {
            if self.since.get(&step) != Some(&t) {
                self.order.pop_front();
                continue;
            }
            if now.saturating_duration_since(t) < linger {
                break;
            }
            self.order.pop_front();
            self.since.remove(&step);
            out.push(step);
        }
    }

    fn pop_oldest(&mut self) -> Option<u64> {
        while let Some((step, t)) = self.order.pop_front() {
            if self.since.get(&step) == Some(&t) {
                self.since.remove(&step);
                return Some(step);
            }
        }
        None
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.since.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINGER: Duration = Duration::from_secs(5);

    fn expired(s: &mut IdleSteps, now: Instant) -> Vec<u64> {
        let mut out = Vec::new();
        s.expired(now, LINGER, &mut out);
        out
    }

    #[test]
    fn an_idle_step_ends_after_the_linger_unless_it_goes_active_again() {
        let t0 = Instant::now();
        let mut s = IdleSteps::default();
        assert_eq!(s.idle(1, t0), None);
        assert_eq!(s.idle(2, t0 + Duration::from_secs(1)), None);
        assert_eq!(s.idle(3, t0 + Duration::from_secs(2)), None);
        assert!(s.active(2));
        assert!(!s.active(2));
        assert_eq!(expired(&mut s, t0 + Duration::from_millis(4999)), Vec::<u64>::new());
        assert_eq!(expired(&mut s, t0 + Duration::from_secs(6)), vec![1]);
        // Idle again later: the linger counts from then.
        assert_eq!(s.idle(2, t0 + Duration::from_secs(6)), None);
        assert_eq!(expired(&mut s, t0 + Duration::from_secs(8)), vec![3]);
        assert_eq!(expired(&mut s, t0 + Duration::from_secs(10)), Vec::<u64>::new());
        assert_eq!(expired(&mut s, t0 + Duration::from_secs(11)), vec![2]);
        assert_eq!(s.len(), 0);
    }

    #[test]
    fn past_the_cap_the_oldest_idle_step_ends_at_once_and_memory_stays_bounded() {
        let t0 = Instant::now();
        let mut s = IdleSteps::default();
        let (cap_since, cap_order) = (s.since.capacity(), s.order.capacity());
        for i in 0..IDLE_STEPS_MAX as u64 {
            assert_eq!(s.idle(i, t0), None);
        }
        assert_eq!(s.idle(1_000_000, t0), Some(0));
        assert_eq!(s.len(), IDLE_STEPS_MAX);
        // Many steps going idle and active again: stale entries are
        // dropped, nothing grows.
        for i in 0..(10 * IDLE_STEPS_MAX as u64) {
            let step = 2_000_000 + i;
            s.idle(step, t0);
            s.active(step);
        }
        assert!(s.order.len() <= 2 * IDLE_STEPS_MAX + 1, "{}", s.order.len());
        // (A map's capacity shrinks by its tombstones; a grown table would
        // report more.)
        assert!(s.since.capacity() <= cap_since, "{} > {cap_since}", s.since.capacity());
        assert_eq!(s.order.capacity(), cap_order);
        // The first of them ended one more old step (the cap was reached).
        assert_eq!(s.len(), IDLE_STEPS_MAX - 1);
    }
}
