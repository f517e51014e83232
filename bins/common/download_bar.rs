//! Hub downloads as a progress bar on stderr (file i of n, bytes, rate), shared by both
//! binaries (`#[path]`-included: it is display code, which stays out of the libraries).

use indicatif::{ProgressBar, ProgressStyle};
use kd_pipeline::hub::DownloadObserver;

/// Draws each file a hub download fetches.
#[derive(Default)]
pub struct DownloadBar {
    bar: Option<ProgressBar>,
}

impl DownloadObserver for DownloadBar {
    fn on_file(&mut self, id: &str, file: &str, (index, files): (usize, usize), bytes: u64) {
        let bar = ProgressBar::new(bytes);
        bar.set_style(
            ProgressStyle::with_template(
                "{prefix:>12} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {msg}",
            )
            .expect("a valid template")
            .progress_chars("=> "),
        );
        bar.set_prefix("download");
        bar.set_message(format!("{id}: {file} ({}/{files})", index + 1));
        self.bar = Some(bar);
    }

    fn on_bytes(&mut self, bytes: u64) {
        if let Some(b) = &self.bar {
            b.inc(bytes);
        }
    }

    fn on_file_done(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish();
        }
    }
}
