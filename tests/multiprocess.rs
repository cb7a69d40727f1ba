//! Multi-process tests: each task is a child process (this binary re-run
//! with RDEV_ROLE set), exchanging thousands of tensors of random sizes,
//! dtypes and shapes (dead and serialized ones included) over shm, checked
//! bit for bit; and SIGKILL of a peer mid-transfer, which must fail the
//! survivor's waiters (or sends) within 5 s.
//!
//! Own harness (harness = false) so children are plain processes; prints
//! "N passed, N failed" at the end.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use rdma_device::node::Node;
use rdma_device::rendezvous::{TensorMeta, FLAG_DEAD, FLAG_SERIALIZED};

/// What tensor `(src, dst, edge, step)` is: derived, so the receiver can
/// check it without being told.
fn spec(seed: u64, src: usize, dst: usize, edge: usize, step: u64) -> (TensorMeta, Vec<u8>) {
    let h = checksum(&[seed.to_le_bytes(), (src as u64).to_le_bytes(), (dst as u64).to_le_bytes(), (edge as u64).to_le_bytes(), step.to_le_bytes()].concat());
    let dtypes = [1u32, 19, 9, 10, 7]; // float, half, int64, bool, string
    let dtype = dtypes[(h % 5) as usize];
    let elem = match dtype { 1 => 4, 19 => 2, 9 => 8, 10 => 1, _ => 1 };
    if h % 17 == 0 {
        return (TensorMeta { dtype, flags: FLAG_DEAD, dims: vec![].into() }, vec![]);
    }
    // Mostly small, sometimes large; the shape changes from step to step.
    let n = match (h >> 8) % 10 {
        0 => ((h >> 16) % (1 << 20)) as usize,
        1..=3 => ((h >> 16) % 65_536) as usize,
        _ => ((h >> 16) % 2048) as usize,
    };
    let rows = 1 + (h >> 40) as usize % 4;
    let n = n / rows * rows;
    let flags = if dtype == 7 { FLAG_SERIALIZED } else { 0 };
    let dims = if dtype == 7 { vec![n as i64] } else { vec![rows as i64, (n / rows) as i64] };
    (TensorMeta { dtype, flags, dims: dims.into() }, pattern(h, n * elem))
}

fn key(src: usize, dst: usize, edge: usize) -> String {
    format!("/job:worker/replica:0/task:{src}/device:CPU:0;1;/job:worker/replica:0/task:{dst}/device:CPU:0;t{edge};0:0")
}

/// Child: task `me` of `ports.len()`; sends `steps` steps on `edges` edges
/// to every other task and checks everything it receives.
fn child_exchange(me: usize, ports: &[u16], edges: usize, steps: u64, seed: u64) -> Result<String, String> {
    let n = ports.len();
    let node = Node::new(small_config(), &task(me), &addr(ports[me])).map_err(|e| e.to_string())?;
    for (j, p) in ports.iter().enumerate() {
        if j != me {
            let c = node.add_peer(&task(j), &addr(p));
            if c.transport.is_none() {
                return Err(format!("no transport to task {j}: {}", c.reason));
            }
        }
    }
    barrier();
    let node = &node;
    let (mut sent, mut got, mut bytes) = (0u64, 0u64, 0u64);
    std::thread::scope(|s| -> Result<(), String> {
        let mut hs = Vec::new();
        for peer in (0..n).filter(|j| *j != me) {
            for edge in 0..edges {
                hs.push(s.spawn(move || -> Result<(u64, u64, u64), String> {
                    for step in 1..=steps {
                        let (m, d) = spec(seed, me, peer, edge, step);
                        send_wait(node, &task(peer), &key(me, peer, edge), step, m, d).map_err(|e| format!("send: {e}"))?;
                    }
                    Ok((steps, 0, 0))
                }));
                hs.push(s.spawn(move || -> Result<(u64, u64, u64), String> {
                    let mut b = 0;
                    for step in 1..=steps {
                        let (m, d) = spec(seed, peer, me, edge, step);
                        let l = recv_wait(node, &task(peer), &key(peer, me, edge), step).map_err(|e| format!("recv: {e}"))?;
                        if l.meta() != &m || checksum(l.bytes()) != checksum(&d) || l.len() != d.len() {
                            return Err(format!("mismatch from task {peer} edge {edge} step {step}: got {:?} {} bytes", l.meta(), l.len()));
                        }
                        b += d.len() as u64;
                    }
                    Ok((0, steps, b))
                }));
            }
        }
        for h in hs {
            let (a, b, c) = h.join().map_err(|_| "thread panicked".to_string())??;
            sent += a;
            got += b;
            bytes += c;
        }
        Ok(())
    })?;
    let st = rdma_device::stats::Stats::global();
    let out = format!(
        "sent={sent} received={got} bytes={bytes} pushed={} inline={} replacements={}",
        st.get("tensors_pushed").unwrap_or(0),
        st.get("inline_tensors").unwrap_or(0),
        st.get("replacements").unwrap_or(0)
    );
    // Our node stays up until every task is done, as a TensorFlow server
    // does: a send is complete once its bytes are in the receiver's slots,
    // and the receiver may still be taking them (a streamed tensor is
    // copied out after its last chunk landed).
    println!("EXCHANGED");
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    Ok(out)
}

/// What the stream roles move, from the environment: tensor bytes
/// (RDEV_BYTES, 4 MiB), arena (RDEV_ARENA, the test default), steps
/// (RDEV_STEPS, unbounded), the step after which to say PROGRESS (20).
fn stream_setup() -> (usize, rdma_device::config::Config, u64, u64) {
    let env = |k: &str, d: u64| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let mut cfg = small_config();
    cfg.arena_bytes = env("RDEV_ARENA", cfg.arena_bytes as u64) as usize;
    (env("RDEV_BYTES", 4 << 20) as usize, cfg, env("RDEV_STEPS", u64::MAX), env("RDEV_PROGRESS_AT", 20))
}

/// Child: send big tensors to task 1 (until killed, or RDEV_STEPS).
fn child_stream_sender(ports: &[u16]) -> Result<String, String> {
    let (bytes, cfg, steps, progress_at) = stream_setup();
    let node = Node::new(cfg, &task(0), &addr(ports[0])).map_err(|e| e.to_string())?;
    node.add_peer(&task(1), &addr(ports[1]));
    barrier();
    let early = std::env::var("RDEV_PROGRESS_EARLY").is_ok();
    for step in 1..=steps {
        let data = pattern(step, bytes);
        let t0 = Instant::now();
        if early && step == progress_at {
            // The parent kills us while this tensor is on its way.
            println!("PROGRESS");
        }
        match send_wait(&node, &task(1), "stream", step, TensorMeta { dtype: 1, flags: 0, dims: vec![bytes as i64 / 4].into() }, data) {
            Ok(()) => {
                if step == progress_at && !early {
                    println!("PROGRESS");
                }
            }
            Err(e) => return Ok(format!("SEND_ERROR after {} ms: {e}", t0.elapsed().as_millis())),
        }
    }
    let c = node.counters();
    Ok(format!("sent {steps}, streamed {}, chunks {}", c.inline_tensors, c.stream_chunks))
}

/// Child: receive the stream; report how fast a failure surfaces.
fn child_stream_receiver(ports: &[u16]) -> Result<String, String> {
    let (bytes, cfg, steps, progress_at) = stream_setup();
    let node = Node::new(cfg, &task(1), &addr(ports[1])).map_err(|e| e.to_string())?;
    node.add_peer(&task(0), &addr(ports[0]));
    barrier();
    for step in 1..=steps {
        let t0 = Instant::now();
        match recv_wait(&node, &task(0), "stream", step) {
            Ok(l) => {
                if l.len() != bytes || checksum(l.bytes()) != checksum(&pattern(step, bytes)) {
                    return Err(format!("corrupt tensor at step {step}"));
                }
                if step == progress_at {
                    println!("PROGRESS");
                }
            }
            Err(e) => return Ok(format!("RECV_ERROR after {} ms: {e}", t0.elapsed().as_millis())),
        }
    }
    Ok(format!("received {steps} intact"))
}

/// Child: says it listens, then waits for the parent's go. Every task
/// listens before any peer contacts it, as in TensorFlow (a task's listener
/// is up before its server answers RPCs): a peer with no listener on first
/// contact is taken not to run the transport.
fn barrier() {
    println!("LISTENING");
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

/// Parent: waits until every child listens, then lets them all go.
fn release(kids: &mut [&mut Child], outs: &[&mpsc::Receiver<String>]) -> Result<(), String> {
    for o in outs {
        wait_line(o, "LISTENING", Duration::from_secs(60))?;
    }
    for k in kids.iter_mut() {
        if let Some(stdin) = k.stdin.as_mut() {
            use std::io::Write;
            writeln!(stdin, "GO").map_err(|e| format!("cannot release a child: {e}"))?;
        }
    }
    Ok(())
}

fn child_main(role: &str) -> ! {
    let ports: Vec<u16> = std::env::var("RDEV_PORTS").unwrap().split(',').map(|p| p.parse().unwrap()).collect();
    let me: usize = std::env::var("RDEV_ME").map(|v| v.parse().unwrap()).unwrap_or(0);
    let r = match role {
        "exchange" => {
            let edges = std::env::var("RDEV_EDGES").unwrap().parse().unwrap();
            let steps = std::env::var("RDEV_STEPS").unwrap().parse().unwrap();
            child_exchange(me, &ports, edges, steps, 42)
        }
        "stream-sender" => child_stream_sender(&ports),
        "stream-receiver" => child_stream_receiver(&ports),
        _ => Err(format!("unknown role {role}")),
    };
    match r {
        Ok(s) => {
            println!("RESULT {s}");
            std::process::exit(0)
        }
        Err(e) => {
            println!("FAILED {e}");
            std::process::exit(1)
        }
    }
}

fn spawn(role: &str, me: usize, ports: &[u16], extra: &[(&str, String)]) -> Child {
    let ps: Vec<String> = ports.iter().map(|p| p.to_string()).collect();
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.env("RDEV_ROLE", role).env("RDEV_ME", me.to_string()).env("RDEV_PORTS", ps.join(","));
    for (k, v) in extra {
        c.env(k, v);
    }
    c.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().expect("spawn child")
}

/// Lines of a child's stdout, as they come.
fn lines(c: &mut Child) -> mpsc::Receiver<String> {
    let out = c.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

fn wait_line(rx: &mpsc::Receiver<String>, prefix: &str, timeout: Duration) -> Result<String, String> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) if l.starts_with(prefix) => return Ok(l),
            Ok(l) if l.starts_with("FAILED") => return Err(l),
            Ok(_) => continue,
            Err(_) => return Err(format!("no {prefix:?} line within {timeout:?}")),
        }
    }
}

fn exchange(n: usize, edges: usize, steps: u64) -> Result<(), String> {
    let ports: Vec<u16> = (0..n).map(|_| free_port()).collect();
    let extra = [("RDEV_EDGES", edges.to_string()), ("RDEV_STEPS", steps.to_string())];
    let mut kids: Vec<Child> = (0..n).map(|i| spawn("exchange", i, &ports, &extra)).collect();
    let outs: Vec<_> = kids.iter_mut().map(lines).collect();
    let mut res = release(&mut kids.iter_mut().collect::<Vec<_>>(), &outs.iter().collect::<Vec<_>>());
    for (i, o) in outs.iter().enumerate().take_while(|_| res.is_ok()) {
        if let Err(e) = wait_line(o, "EXCHANGED", Duration::from_secs(240)) {
            res = Err(format!("task {i}: {e}"));
            break;
        }
    }
    if res.is_ok() {
        for k in kids.iter_mut() {
            if let Some(stdin) = k.stdin.as_mut() {
                use std::io::Write;
                let _ = writeln!(stdin, "END");
            }
        }
    }
    for (i, o) in outs.iter().enumerate().take_while(|_| res.is_ok()) {
        match wait_line(o, "RESULT", Duration::from_secs(240)) {
            Ok(l) => println!("  task {i}: {l}"),
            Err(e) => {
                res = Err(format!("task {i}: {e}"));
                break;
            }
        }
    }
    for k in &mut kids {
        let _ = k.kill();
        let _ = k.wait();
    }
    res
}

fn two_processes_exchange_thousands() -> Result<(), String> {
    // 2 tasks × 4 edges × 2 directions × 300 steps = 2400 tensors.
    exchange(2, 4, 300)
}

fn three_processes_exchange_thousands() -> Result<(), String> {
    // 3 tasks all-to-all × 2 edges × 250 steps = 3000 tensors.
    exchange(3, 2, 250)
}

fn kill(c: &mut Child) {
    // SAFETY: sending a signal to our own child.
    unsafe { libc::kill(c.id() as i32, libc::SIGKILL) };
    let _ = c.wait();
}

/// Tensors larger than the receiver's whole arena (streamed through its
/// stream slots) between two processes, checked byte for byte.
fn streamed_tensors_between_processes() -> Result<(), String> {
    let ports = [free_port(), free_port()];
    let env = [("RDEV_BYTES", (200 << 20).to_string()), ("RDEV_ARENA", (16 << 20).to_string()), ("RDEV_STEPS", "3".to_string())];
    let mut s = spawn("stream-sender", 0, &ports, &env);
    let mut r = spawn("stream-receiver", 1, &ports, &env);
    let (so, ro) = (lines(&mut s), lines(&mut r));
    release(&mut [&mut s, &mut r], &[&so, &ro])?;
    let res = wait_line(&ro, "RESULT", Duration::from_secs(120)).and_then(|rl| Ok((rl, wait_line(&so, "RESULT", Duration::from_secs(30))?)));
    kill(&mut s);
    kill(&mut r);
    let (rl, sl) = res?;
    println!("  receiver: {rl}; sender: {sl}");
    // 3 tensors of 200 MiB in chunks of (16 MiB / 32 - header) bytes.
    let chunks = 3 * (200u64 << 20).div_ceil((16 << 20) / 32 - 256);
    if !sl.contains(&format!("streamed 3, chunks {chunks}")) {
        return Err(format!("expected 3 streamed tensors in {chunks} chunks: {sl}"));
    }
    Ok(())
}

/// SIGKILL the sender mid-stream: the receiver's pending recv fails < 5 s.
fn sender_killed_mid_transfer() -> Result<(), String> {
    sender_killed(&[])
}

/// The same while a tensor larger than the arena is being streamed (the
/// sender says PROGRESS as it starts sending it: 512 MiB take ~0.3-1.3 s).
fn sender_killed_mid_stream() -> Result<(), String> {
    let env = [
        ("RDEV_BYTES", (512 << 20).to_string()),
        ("RDEV_ARENA", (16 << 20).to_string()),
        ("RDEV_PROGRESS_AT", "1".to_string()),
        ("RDEV_PROGRESS_EARLY", "1".to_string()),
    ];
    sender_killed(&env)
}

fn sender_killed(env: &[(&str, String)]) -> Result<(), String> {
    let ports = [free_port(), free_port()];
    let mut s = spawn("stream-sender", 0, &ports, env);
    let mut r = spawn("stream-receiver", 1, &ports, env);
    let (so, ro) = (lines(&mut s), lines(&mut r));
    release(&mut [&mut s, &mut r], &[&so, &ro])?;
    if env.iter().any(|(k, _)| *k == "RDEV_PROGRESS_EARLY") {
        wait_line(&so, "PROGRESS", Duration::from_secs(60))?;
        std::thread::sleep(Duration::from_millis(100));
    } else {
        wait_line(&ro, "PROGRESS", Duration::from_secs(60))?;
    }
    let t0 = Instant::now();
    kill(&mut s);
    let l = wait_line(&ro, "RESULT", Duration::from_secs(5));
    let dt = t0.elapsed();
    kill(&mut r);
    let l = l?;
    println!("  receiver: {l} ({} ms after SIGKILL)", dt.as_millis());
    if !l.contains("RECV_ERROR") || dt > Duration::from_secs(5) {
        return Err(format!("expected a receive error within 5 s, got {l:?} after {dt:?}"));
    }
    Ok(())
}

/// SIGKILL the receiver mid-stream: the sender's blocked send fails < 5 s.
fn receiver_killed_mid_transfer() -> Result<(), String> {
    let ports = [free_port(), free_port()];
    let mut s = spawn("stream-sender", 0, &ports, &[]);
    let mut r = spawn("stream-receiver", 1, &ports, &[]);
    let (so, ro) = (lines(&mut s), lines(&mut r));
    release(&mut [&mut s, &mut r], &[&so, &ro])?;
    wait_line(&so, "PROGRESS", Duration::from_secs(60))?;
    let t0 = Instant::now();
    kill(&mut r);
    let l = wait_line(&so, "RESULT", Duration::from_secs(std::env::var("RK_WAIT").map(|v| v.parse().unwrap()).unwrap_or(5)));
    let dt = t0.elapsed();
    kill(&mut s);
    let l = l?;
    println!("  sender: {l} ({} ms after SIGKILL)", dt.as_millis());
    if !l.contains("SEND_ERROR") || dt > Duration::from_secs(5) {
        return Err(format!("expected a send error within 5 s, got {l:?} after {dt:?}"));
    }
    Ok(())
}

fn main() {
    if let Ok(role) = std::env::var("RDEV_ROLE") {
        child_main(&role);
    }
    let filter: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    type Case = fn() -> Result<(), String>;
    let cases: &[(&str, Case)] = &[
        ("two_processes_exchange_thousands", two_processes_exchange_thousands),
        ("three_processes_exchange_thousands", three_processes_exchange_thousands),
        ("sender_killed_mid_transfer", sender_killed_mid_transfer),
        ("streamed_tensors_between_processes", streamed_tensors_between_processes),
        ("sender_killed_mid_stream", sender_killed_mid_stream),
        ("receiver_killed_mid_transfer", receiver_killed_mid_transfer),
    ];
    let (mut passed, mut failed) = (0, 0);
    for (name, f) in cases {
        if !filter.is_empty() && !filter.iter().any(|x| name.contains(x.as_str())) {
            continue;
        }
        let t0 = Instant::now();
        println!("test {name} ...");
        match f() {
            Ok(()) => {
                passed += 1;
                println!("test {name} ... ok ({:.1} s)", t0.elapsed().as_secs_f64());
            }
            Err(e) => {
                failed += 1;
                println!("test {name} ... FAILED: {e}");
            }
        }
    }
    println!("\nmultiprocess: {passed} passed, {failed} failed");
    std::process::exit(if failed == 0 { 0 } else { 1 });
}
