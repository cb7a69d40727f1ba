//! The deterministic simulation with faults (see `rdma_device::sim`).
//!
//! `rdma-device-sim --seeds N [--first S] [--steps K] [--json]`: runs seeds
//! S..S+N, each under two schedules (reordered; reordered with faults),
//! prints every violation with the seed that replays it, and ends with
//! `sim: N seeds, S schedules, V violations` (then the same as JSON).
//! Exit status 1 when any violation was found. `--seed S` runs one seed
//! again (same workload and choices).

use std::time::Instant;

fn main() {
    let mut seeds = 100u64;
    let mut first = 1u64;
    let mut steps = 6u64;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |what: &str| -> u64 {
            match args.next().and_then(|v| v.parse().ok()) {
                Some(v) => v,
                None => {
                    eprintln!("rdma-device-sim: {what} takes a number");
                    std::process::exit(2);
                }
            }
        };
        match a.as_str() {
            "--seeds" => seeds = num("--seeds"),
            "--first" => first = num("--first"),
            "--seed" => {
                first = num("--seed");
                seeds = 1;
            }
            "--steps" => steps = num("--steps").max(1),
            "-h" | "--help" => {
                println!("usage: rdma-device-sim [--seeds N] [--first S | --seed S] [--steps K]");
                return;
            }
            other => {
                eprintln!("rdma-device-sim: unknown argument {other} (see --help)");
                std::process::exit(2);
            }
        }
    }
    // The simulation reports what it finds; the library's own logging of
    // the faults it injects would only be noise here.
    let t0 = Instant::now();
    let mut total = rdma_device::sim::Report::default();
    let chunk = 50;
    let mut at = first;
    while at < first + seeds {
        let n = chunk.min(first + seeds - at);
        let r = rdma_device::sim::run(at, n, steps);
        for (seed, sched, what) in &r.violations {
            println!("violation: seed {seed} schedule {} ({}): {what}", sched, if *sched == 1 { "faults" } else { "reordered" });
        }
        total.seeds += r.seeds;
        total.schedules += r.schedules;
        total.events += r.events;
        total.delivered += r.delivered;
        total.recv_failed += r.recv_failed;
        total.calls_ok += r.calls_ok;
        total.calls_failed += r.calls_failed;
        total.faults += r.faults;
        total.violations.extend(r.violations);
        at += n;
        eprintln!("sim: {} of {seeds} seeds, {:.0} s", at - first, t0.elapsed().as_secs_f64());
    }
    let v = total.violations.len();
    println!("sim: {} seeds, {} schedules, {v} violations", total.seeds, total.schedules);
    println!(
        "{{\"seeds\": {}, \"schedules\": {}, \"events\": {}, \"tensors_delivered\": {}, \"receives_failed\": {}, \"calls_answered\": {}, \"calls_failed\": {}, \"faults\": {}, \"violations\": {v}, \"first_seed\": {first}, \"steps\": {steps}, \"seconds\": {:.1}}}",
        total.seeds,
        total.schedules,
        total.events,
        total.delivered,
        total.recv_failed,
        total.calls_ok,
        total.calls_failed,
        total.faults,
        t0.elapsed().as_secs_f64()
    );
    if v > 0 {
        std::process::exit(1);
    }
}
