//! The hot path allocates nothing per packet: once an engine's session is up and the caller's
//! outbox has grown to a batch's size, encrypting and decrypting further batches makes no heap
//! allocation at all. A counting allocator checks it (only on the thread under test, so other
//! tests running in parallel do not count).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::net::IpAddr;
use std::time::Instant;

use dataplane::testing::{ip_packet, EnginePair};
use dataplane::Outbox;

/// The system allocator, counting allocations made by threads that asked to be counted.
struct CountingAllocator;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call is forwarded unchanged to the system allocator; the counters are
// thread-local cells with const initialisers, which never allocate.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: forwarded with the caller's pointer, layout and size.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's pointer and layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

fn count() {
    let _ = COUNTING.try_with(|on| {
        if on.get() {
            let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        }
    });
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Heap allocations `f` makes on this thread.
fn allocations_in(f: impl FnOnce()) -> u64 {
    ALLOCATIONS.with(|n| n.set(0));
    COUNTING.with(|on| on.set(true));
    f();
    COUNTING.with(|on| on.set(false));
    ALLOCATIONS.with(Cell::get)
}

/// Packets per batch, as a worker reads them.
const BATCH: usize = 64;

#[test]
fn steady_state_batches_allocate_nothing() {
    let mut pair = EnginePair::new();
    let now = Instant::now();
    pair.send_a_to_b(now, b"session up");
    let from = pair.a.addr;
    let sizes = [40usize, 576, 1420];
    let packets: Vec<Vec<u8>> = (0..BATCH)
        .map(|i| {
            let payload = vec![i as u8; sizes[i % sizes.len()] - 20];
            ip_packet(pair.a.tunnel_ip, pair.b.tunnel_ip, &payload)
        })
        .collect();
    let mut sealed = Outbox::with_capacity(BATCH, 2048);
    let mut opened = Outbox::with_capacity(BATCH, 2048);
    let round = |sealed: &mut Outbox, opened: &mut Outbox| {
        sealed.clear();
        opened.clear();
        pair.a
            .engine
            .handle_tunnel_packets(now, packets.iter().map(Vec::as_slice), sealed);
        pair.b.engine.handle_datagrams(
            now,
            sealed.to_network.iter().map(|(_, d)| (from, d)),
            opened,
        );
    };
    // Warm up: the outboxes reach their working size.
    round(&mut sealed, &mut opened);
    assert_eq!(opened.to_tunnel.len(), BATCH, "every packet crossed");
    let made = allocations_in(|| {
        for _ in 0..100 {
            round(&mut sealed, &mut opened);
        }
    });
    assert_eq!(opened.to_tunnel.len(), BATCH, "every packet crossed");
    let last: Vec<IpAddr> = opened
        .to_tunnel
        .iter()
        .filter_map(|(_, p)| dataplane::packet::destination(p))
        .collect();
    assert!(last.iter().all(|d| *d == pair.b.tunnel_ip));
    assert_eq!(
        made, 0,
        "100 batches of {BATCH} packets each way allocated {made} times"
    );
}

#[test]
fn the_counter_sees_an_allocation() {
    // The check above can fail: an allocation on this thread is counted.
    let made = allocations_in(|| drop(std::hint::black_box(vec![0u8; 100])));
    assert_eq!(made, 1);
}
