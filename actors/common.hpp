#pragma once
// What every duet actor shares: the inbound message type the transport delivers, the
// timer atoms, and the typed interface all workers implement.
#include <caf/all.hpp>

#include "messages/codec.hpp"
#include "runtime/outbox.hpp"
#include "runtime/transport.hpp"

namespace duet {

/// A decoded envelope with the message's frames; the actor decodes the body by type.
struct inbound {
  msg::envelope env;
  msg::frames frames;
  // When the node handed it to the actor (unix ms): an actor busy with a synchronous engine
  // step reads its mailbox late, and a prompt's queue time starts here, not at the read.
  int64_t received_ms = 0;
};

}  // namespace duet

// Travels only between actors of one process (never serialized by CAF).
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(duet::inbound)

namespace duet {

using tick_atom = caf::atom_constant<caf::atom("tick")>;        // deadlines and leases
using step_done_atom = caf::atom_constant<caf::atom("stepdone")>;  // engine step finished
using report_atom = caf::atom_constant<caf::atom("report")>;    // periodic load report

/// The typed interface of every duet actor.
using duet_actor = caf::typed_actor<caf::reacts_to<inbound>, caf::reacts_to<tick_atom>,
                                    caf::reacts_to<step_done_atom>, caf::reacts_to<report_atom>>;

/// Hands everything a core queued to the transport.
inline void flush(outbox& box, transport& net) {
  for (auto& m : box.take()) {
    [[maybe_unused]] bool accepted = net.send(std::move(m));
  }
}

}  // namespace duet
