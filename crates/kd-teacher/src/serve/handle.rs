//! A server on a thread of its own, and its handle.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::oneshot;

use super::config::check_access;
use super::{ServeConfig, router};
use crate::error::{Result, TeacherError};
use crate::local::LocalTeacher;

/// How long a shutdown waits for requests in flight.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// A server running on its own thread; dropping the handle (or [`ServerHandle::shutdown`])
/// stops it gracefully.
#[derive(Debug)]
pub struct ServerHandle {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<std::io::Result<()>>>,
}

impl ServerHandle {
    /// The address it listens on (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The base URL, `http://ip:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, finishes requests in flight (for up to 5 s) and waits for the thread.
    pub fn shutdown(mut self) -> Result<()> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(Err(e))) => Err(TeacherError::Serve(e.to_string())),
            Some(Err(_)) => Err(TeacherError::Serve("the server thread panicked".into())),
            _ => Ok(()),
        }
    }

    /// Blocks until the server stops (it runs until shut down or killed).
    pub fn wait(mut self) -> Result<()> {
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(Err(e))) => Err(TeacherError::Serve(e.to_string())),
            Some(Err(_)) => Err(TeacherError::Serve("the server thread panicked".into())),
            _ => Ok(()),
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        let _ = self.stop_and_join();
    }
}

/// Serves `teacher` on `addr` (e.g. `0.0.0.0:30000`, or `127.0.0.1:0` for any free port)
/// from a thread of its own. Fails closed: an empty key, or no key on an address other than
/// loopback without [`ServeConfig::allow_unauthenticated`], is an error.
pub fn spawn_server(
    teacher: LocalTeacher,
    addr: &str,
    config: ServeConfig,
) -> Result<ServerHandle> {
    let std_listener = std::net::TcpListener::bind(addr)
        .map_err(|e| TeacherError::Serve(format!("cannot listen on {addr}: {e}")))?;
    std_listener
        .set_nonblocking(true)
        .map_err(|e| TeacherError::Serve(e.to_string()))?;
    let local = std_listener
        .local_addr()
        .map_err(|e| TeacherError::Serve(e.to_string()))?;
    check_access(&config, local)?;
    let app = router(teacher, config);
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("kd-teacher-server".into())
        .spawn(move || -> std::io::Result<()> {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(std_listener)?;
                let (grace_tx, grace_rx) = oneshot::channel::<()>();
                let serve = axum::serve(listener, app).with_graceful_shutdown(async {
                    let _ = stop_rx.await;
                    let _ = grace_tx.send(());
                });
                // Connections still open (a client's keep-alive pool) get a grace period,
                // then are cut when the runtime stops.
                tokio::select! {
                    r = serve => r,
                    _ = async {
                        if grace_rx.await.is_ok() {
                            tokio::time::sleep(SHUTDOWN_GRACE).await;
                        } else {
                            std::future::pending::<()>().await;
                        }
                    } => Ok(()),
                }
            })
        })
        .map_err(|e| TeacherError::Serve(e.to_string()))?;
    tracing::info!(%local, "teacher server listening");
    Ok(ServerHandle {
        addr: local,
        stop: Some(stop_tx),
        thread: Some(thread),
    })
}
