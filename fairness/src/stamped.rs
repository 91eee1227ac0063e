//! A value with a stamp that changes whenever the value may have changed: every mutable
//! access takes a new stamp, from a counter no two values share. Derived data (the
//! plan's grid columns, [`crate::federation`]) keyed by a stamp is therefore never stale,
//! whatever code changes the value, because the type system routes every change through
//! [`std::ops::DerefMut`].
//!
//! The stamp is not part of the value: it is not serialized (a deserialized value gets a
//! fresh one), and equality ignores it, so replicated state compares and encodes exactly
//! as the bare value would.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

static NEXT: AtomicU64 = AtomicU64::new(1);

/// A stamp no other value has had (never 0).
fn fresh() -> u64 {
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// `T`, stamped. Serializes, compares and prints as `T`.
#[derive(Serialize, Deserialize)]
#[serde(transparent)]
pub struct Stamped<T> {
    value: T,
    #[serde(skip, default = "fresh")]
    stamp: u64,
}

impl<T> Stamped<T> {
    /// `value` with a fresh stamp.
    pub fn new(value: T) -> Self {
        Stamped { value, stamp: fresh() }
    }

    /// The current stamp: equal to an earlier reading only if nothing could have
    /// changed the value in between.
    pub fn stamp(&self) -> u64 {
        self.stamp
    }
}

impl<T> std::ops::Deref for Stamped<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T> std::ops::DerefMut for Stamped<T> {
    fn deref_mut(&mut self) -> &mut T {
        self.stamp = fresh();
        &mut self.value
    }
}

impl<'a, T> IntoIterator for &'a Stamped<T>
where
    &'a T: IntoIterator,
{
    type Item = <&'a T as IntoIterator>::Item;
    type IntoIter = <&'a T as IntoIterator>::IntoIter;
    fn into_iter(self) -> Self::IntoIter {
        (&self.value).into_iter()
    }
}

impl<T: Default> Default for Stamped<T> {
    fn default() -> Self {
        Stamped::new(T::default())
    }
}

impl<T: Clone> Clone for Stamped<T> {
    /// The copy keeps the stamp: it holds the same value, and either one's next change
    /// takes a new stamp.
    fn clone(&self) -> Self {
        Stamped {
            value: self.value.clone(),
            stamp: self.stamp,
        }
    }
}

impl<T: PartialEq> PartialEq for Stamped<T> {
    fn eq(&self, other: &Self) -> bool {
        self.value == other.value
    }
}

impl<T: Eq> Eq for Stamped<T> {}

impl<T: std::fmt::Debug> std::fmt::Debug for Stamped<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.value.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_mutable_access_takes_a_new_stamp_and_the_stamp_is_invisible() {
        let mut a = Stamped::new(vec![1, 2]);
        let s0 = a.stamp();
        assert_eq!(a.len(), 2);
        assert_eq!(a.stamp(), s0, "reads keep it");
        a.push(3);
        let s1 = a.stamp();
        assert_ne!(s1, s0);
        let b = a.clone();
        assert_eq!((b.stamp(), &*b), (s1, &vec![1, 2, 3]));
        let json = serde_json::to_string(&a).unwrap_or_default();
        assert_eq!(json, "[1,2,3]", "serialized as the bare value");
        let c: Stamped<Vec<i32>> = serde_json::from_str(&json).unwrap_or_default();
        assert_eq!(c, a, "equal values compare equal whatever their stamps");
        assert!(
            c.stamp() != s1 && c.stamp() != s0,
            "a decoded value has a stamp of its own"
        );
        assert_ne!(
            Stamped::<Vec<i32>>::default().stamp(),
            Stamped::<Vec<i32>>::default().stamp()
        );
    }
}
