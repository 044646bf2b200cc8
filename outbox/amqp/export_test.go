package amqp

// PendingReturns is how many returned messages the Publisher's current
// channel holds for publications that have not collected them.
func PendingReturns(p *Publisher) int {
	p.sem <- struct{}{}
	r := p.rets
	<-p.sem
	if r == nil {
		return 0
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.returned)
}
