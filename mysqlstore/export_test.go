package mysqlstore

// DeadlocksRetried reports how many deadlocks the stores of this process retried.
func DeadlocksRetried() int64 { return deadlocks.Load() }
