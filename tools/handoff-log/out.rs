//! Buffered stdout that turns a closed pipe (`handoff-log show RUN | head`) into a quiet exit.

use crate::CliError;
use std::io::{BufWriter, ErrorKind, Stdout, Write};

pub struct Out {
    w: BufWriter<Stdout>,
}

impl Out {
    pub fn new() -> Self {
        Out { w: BufWriter::with_capacity(1 << 16, std::io::stdout()) }
    }

    pub fn line(&mut self, s: &str) -> Result<(), CliError> {
        self.w.write_all(s.as_bytes()).and_then(|_| self.w.write_all(b"\n")).map_err(map)
    }

    pub fn flush(&mut self) -> Result<(), CliError> {
        self.w.flush().map_err(map)
    }
}

fn map(e: std::io::Error) -> CliError {
    if e.kind() == ErrorKind::BrokenPipe {
        // The reader went away: stop quietly, successfully.
        CliError::new(0, "")
    } else {
        CliError::new(2, format!("writing to stdout: {e}"))
    }
}
