//! Handle tables: the tensors a shim may name during one call.
//!
//! A handle is `generation << 16 | index`. The generation changes with every call of an
//! instance (and is never 0), so a handle kept from an earlier call is recognised as stale,
//! and small integers (0, 1, …) are recognised as forged. Generations run from 1 to
//! [`MAX_GENERATION`] and start over, so that every handle is a positive `i32`: `scratch`
//! returns its handle as one, and a negative return is a refusal.

use bytes::Bytes;
use kiln_kernel_abi::DType;

/// How the shim may reach a tensor's bytes.
#[derive(Clone, Debug)]
pub enum Access {
    /// Host bytes the shim may read (CPU inputs).
    Read(Bytes),
    /// Host bytes the shim may read and write (CPU outputs and scratch).
    Write(Vec<u8>),
    /// A tile's share of a CPU output (ABI.md §6.1.2): `bytes` are the tensor's bytes from
    /// `start`; reads and writes elsewhere in the tensor are refused.
    Window { start: u64, bytes: Vec<u8> },
    /// A string output of a CPU call (ABI.md §6): empty at first, it grows by the bytes the shim
    /// writes at its end, up to the slot's `nbytes` (the session's tensor limit); the host checks
    /// them as a string tensor of the output's shape after the call.
    Strings(Vec<u8>),
    /// Bytes the shim cannot reach (device memory during dispatch; anything during inference).
    Opaque,
    /// A CPU input whose buffer the output bound in place to it takes over (ABI.md §7.8, manifest
    /// schema 18 and later): the node call turns it into [`Access::Alias`] of that output's slot.
    InPlace,
    /// A CPU input that is output slot `.0`'s buffer: reads see the output's bytes, what the shim
    /// has written there included, as a kernel sees a buffer bound in place on the GPU.
    Alias(usize),
}

/// One tensor of the table.
#[derive(Debug)]
pub struct Slot {
    pub dtype: Option<DType>,
    /// Size in bytes; bounds of every offset and extent.
    pub nbytes: u64,
    pub access: Access,
    /// Outputs and scratch: what a GEMM may write.
    pub writable: bool,
}

/// Why a handle was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum HandleError {
    /// The handle was never issued (or names no slot of this call).
    Forged(u32),
    /// The handle was issued for an earlier call.
    Stale(u32),
}

impl std::fmt::Display for HandleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HandleError::Forged(h) => write!(f, "handle {h:#x} is not in this call's handle table"),
            HandleError::Stale(h) => write!(f, "handle {h:#x} belongs to an earlier call (stale)"),
        }
    }
}

/// Most slots of one call (inputs, outputs and scratch): the index has 16 bits, and
/// 0xffff is never a valid index.
pub const MAX_SLOTS: usize = 0xffff;

/// The tensors of one call.
#[derive(Debug, Default)]
pub struct HandleTable {
    generation: u16,
    slots: Vec<Slot>,
}

/// The last generation before they start over at 1: handles stay below 2³¹. (Generations up
/// to 0xffff made the 32,768th call of an instance hand `scratch` a negative handle, which the
/// shim read as a refusal: a CPU decode failed once its RmsNormLinear instance had made that many
/// calls, inference and CPU references together.)
pub const MAX_GENERATION: u16 = 0x7fff;

impl HandleTable {
    /// An empty table for the call after one of generation `previous`.
    pub fn next(previous: u16) -> HandleTable {
        let generation = if previous >= MAX_GENERATION { 1 } else { previous + 1 };
        HandleTable { generation, slots: Vec::new() }
    }

    pub fn generation(&self) -> u16 {
        self.generation
    }

    /// Adds a slot and returns its handle.
    pub fn push(&mut self, slot: Slot) -> u32 {
        self.slots.push(slot);
        ((self.generation as u32) << 16) | (self.slots.len() as u32 - 1)
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The slot index of `handle`.
    pub fn index(&self, handle: u32) -> Result<usize, HandleError> {
        let (generation, index) = ((handle >> 16) as u16, (handle & 0xffff) as usize);
        if generation == self.generation && index < self.slots.len() {
            Ok(index)
        } else if (1..=MAX_GENERATION).contains(&generation) && generation != self.generation && index < 0xffff {
            Err(HandleError::Stale(handle))
        } else {
            Err(HandleError::Forged(handle))
        }
    }

    pub fn get(&self, handle: u32) -> Result<&Slot, HandleError> {
        self.index(handle).map(|i| &self.slots[i])
    }

    pub fn get_mut(&mut self, handle: u32) -> Result<&mut Slot, HandleError> {
        self.index(handle).map(move |i| &mut self.slots[i])
    }

    /// Every slot, by index.
    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// Every slot, by index (a checked `Gemm`'s handles are indices).
    pub fn slots_mut(&mut self) -> &mut [Slot] {
        &mut self.slots
    }

    /// Points each [`Access::InPlace`] input at the output bound in place to it: `in_place` lists
    /// (input slot, output slot) pairs. An `InPlace` input with no output stays without host bytes.
    pub fn alias_in_place(&mut self, in_place: &[(usize, usize)]) {
        for &(input, output) in in_place {
            if let Some(s) = self.slots.get_mut(input).filter(|s| matches!(s.access, Access::InPlace)) {
                s.access = Access::Alias(output);
            }
        }
    }

    /// Takes the slots out, leaving the table empty (every handle now invalid).
    pub fn take(&mut self) -> Vec<Slot> {
        std::mem::take(&mut self.slots)
    }
}

/// The host bytes of slot `index` that a host import may read: an input's, an output's or
/// scratch's written so far, or for an [`Access::Alias`] input its output's. `None`: no such slot,
/// or no whole host bytes (opaque, a tile's window, a string output, an output taken out while an
/// import writes it).
pub fn readable(slots: &[Slot], index: usize) -> Option<&[u8]> {
    match &slots.get(index)?.access {
        Access::Read(b) => Some(&b[..]),
        Access::Write(v) => Some(&v[..]),
        Access::Alias(output) => match &slots.get(*output)?.access {
            Access::Write(v) => Some(&v[..]),
            _ => None,
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot() -> Slot {
        Slot { dtype: Some(DType::F32), nbytes: 4, access: Access::Opaque, writable: false }
    }

    #[test]
    fn handles_are_valid_for_one_call_only() {
        let mut t = HandleTable::next(0);
        let h = t.push(slot());
        assert_eq!(t.index(h), Ok(0));
        assert_eq!(t.index(0), Err(HandleError::Forged(0)));
        assert_eq!(t.index(h + 1), Err(HandleError::Forged(h + 1)));
        let mut t2 = HandleTable::next(t.generation());
        t2.push(slot());
        assert_eq!(t2.index(h), Err(HandleError::Stale(h)));
        assert_eq!(HandleTable::next(u16::MAX).generation(), 1, "generation 0 is never issued");
    }

    /// Over more calls than generations, every handle is a positive `i32` (what `scratch`
    /// returns) of a generation that is never 0, and the previous call's handles stay stale.
    #[test]
    fn handles_stay_positive_i32_over_every_generation() {
        let mut generation = 0;
        let mut previous: Option<u32> = None;
        for call in 0..3 * (MAX_GENERATION as u32 + 1) {
            let mut t = HandleTable::next(generation);
            generation = t.generation();
            assert_ne!(generation, 0, "call {call}");
            for _ in 0..3 {
                t.push(slot());
            }
            let h = t.push(slot());
            assert!(i32::try_from(h).is_ok_and(|v| v > 0), "call {call}: handle {h:#x} is not a positive i32");
            if let Some(p) = previous {
                assert_eq!(t.index(p), Err(HandleError::Stale(p)), "call {call}");
            }
            previous = Some(h);
        }
    }
}
