package mysqlstore

// DeadlocksRetried reports how many deadlocks the stores of this process retried.
func DeadlocksRetried() int64 { return deadlocks.Load() }

// NoStepCAS makes BeginStep of an existing step skip its optimistic path and
// decide in its transaction, so that tests run that path too.
func NoStepCAS(s *Store) { s.noStepCAS.Store(true) }

// StepOwnConn makes every step operation run its statements on a connection
// of its own, by their text, as it does when the pool is full, so that tests
// run that path too.
func StepOwnConn(s *Store) { s.stepOwnConn.Store(true) }
