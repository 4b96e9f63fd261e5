//! Progress on long work (indicatif): a bar over a known number of steps, or a spinner, drawn
//! on stderr only when stderr is a terminal and `-q` is not given, so that pipes, logs and
//! JSON on stdout never see it. Lines printed while a bar is shown go through [`Progress::line`]
//! so that the bar is redrawn below them.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar or spinner; finished and cleared when dropped.
pub struct Progress(ProgressBar);

fn target() -> ProgressDrawTarget {
    if super::output::quiet() || !std::io::stderr().is_terminal() {
        ProgressDrawTarget::hidden()
    } else {
        ProgressDrawTarget::stderr()
    }
}

impl Progress {
    /// A bar over `len` steps: `what [=====>    ] 12/40 (eta 3s) message`.
    pub fn bar(len: u64, what: &str) -> Progress {
        let pb = ProgressBar::with_draw_target(Some(len), target());
        let style = ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} ({eta}) {wide_msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
        pb.set_style(style);
        pb.set_prefix(what.to_string());
        Progress(pb)
    }

    /// A spinner for work of unknown length: `⠋ what (3.2s)`.
    pub fn spinner(what: &str) -> Progress {
        let pb = ProgressBar::with_draw_target(None, target());
        let style = ProgressStyle::with_template("{spinner} {prefix} ({elapsed}) {wide_msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner());
        pb.set_style(style);
        pb.set_prefix(what.to_string());
        pb.enable_steady_tick(Duration::from_millis(120));
        Progress(pb)
    }

    /// One step done; `msg` names what runs next (a test, a package).
    pub fn step(&self, msg: &str) {
        self.0.inc(1);
        self.0.set_message(msg.to_string());
    }

    /// Names what runs now without counting a step.
    pub fn message(&self, msg: &str) {
        self.0.set_message(msg.to_string());
    }

    /// Prints a line on stdout with the bar out of the way.
    pub fn line(&self, text: &str) {
        self.suspend(|| println!("{text}"));
    }

    /// Runs `f` (which prints) with the bar out of the way.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        self.0.suspend(f)
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.0.finish_and_clear();
    }
}
