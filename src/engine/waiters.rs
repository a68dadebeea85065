//! In-process wake-ups for callers waiting on a key (`Prefer: wait`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

pub(super) type Slot = (String, [u8; 32]);

/// In-process wake-ups for callers waiting on a key (`Prefer: wait`).
#[derive(Default)]
pub(super) struct Waiters {
    slots: Mutex<HashMap<Slot, Arc<Notify>>>,
}

// === impl Waiters ===

impl Waiters {
    /// The slot's notifier, shared by every waiter on the key; it stays in the
    /// map until the last of them leaves.
    pub(super) fn subscribe(&self, slot: &Slot) -> Arc<Notify> {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots.entry(slot.clone()).or_default().clone()
    }

    /// Drops the slot when the last waiter leaves.
    pub(super) fn unsubscribe(&self, slot: &Slot, notify: Arc<Notify>) {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(current) = slots.get(slot)
            && Arc::ptr_eq(current, &notify)
            && Arc::strong_count(&notify) <= 2
        {
            slots.remove(slot);
        }
    }

    pub(super) fn wake(&self, tenant: &str, key_hash: &[u8]) {
        let Ok(hash) = <[u8; 32]>::try_from(key_hash) else {
            return;
        };
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = slots.get(&(tenant.to_owned(), hash)) {
            n.notify_waiters();
        }
    }
}
