package sqlitestore

// CopiesResponses implements idem.ResponseCopier: the store encodes what it
// keeps of a response into its statements or commands, and keeps no reference
// to it once the call — in a transaction, Commit or Rollback — has returned.
func (s *Store) CopiesResponses() bool { return true }
