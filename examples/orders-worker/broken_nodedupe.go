//go:build idem_broken_worker

package main

// Built with -tags idem_broken_worker, the worker applies every delivery of
// an event, without the consumer's dedupe: the pipeline proof
// (cmd/idem TestOutboxPipeline) uses it to see its exactly-once check fail.
func init() { applyWithoutDedupe = true }
