#include "kvstash/engine/node_offload.h"

#include "kvstash/common/logging.h"
#include "kvstash/connector/kv_connector.h"

namespace kvstash::engine {
namespace {

connector::OffloadGroupConfig OffloadGroupOf(const AttentionSpec& spec) {
  connector::OffloadGroupConfig g;
  g.gpu_block_size = spec.block_size;
  switch (spec.kind) {
    case AttentionSpec::Kind::kFull:
      g.kind = connector::OffloadGroupKind::kFull;
      break;
    case AttentionSpec::Kind::kSlidingWindow:
      g.kind = connector::OffloadGroupKind::kSlidingWindow;
      g.window = spec.window;
      break;
    case AttentionSpec::Kind::kChunkedLocal:
      g.kind = connector::OffloadGroupKind::kChunkedLocal;
      g.window = spec.chunk;
      break;
    case AttentionSpec::Kind::kState:
      g.kind = connector::OffloadGroupKind::kState;
      break;
  }
  return g;
}

connector::OffloadRequestView ViewOf(const Request& r) {
  return {r.id, r.tokens.size(), r.hasher->hashes(), r.do_remote_decode};
}

class NodeKvOffload : public KvOffload {
 public:
  NodeKvOffload(std::unique_ptr<connector::KvConnector> connector, const KvCacheManager* kv)
      : connector_(std::move(connector)), kv_(kv) {}

  std::optional<size_t> MatchedTokens(const Request& r, size_t num_computed) override {
    return connector_->GetNumNewMatchedTokens(ViewOf(r), num_computed);
  }
  Status StartLoad(const Request& r, const std::vector<std::vector<BlockId>>& tables,
                   size_t num_external) override {
    return connector_->UpdateStateAfterAlloc(ViewOf(r), tables, num_external);
  }

  std::vector<std::pair<RequestId, JobId>> BeginStep(const SchedulerOutput& out,
                                                     std::span<const RequestId> finished) override {
    connector::SchedulerStepView view;
    for (const ScheduledSeq& s : out.seqs) {
      Request* r = s.request;
      connector::ScheduledRequestView v;
      v.request = ViewOf(*r);
      v.num_computed_tokens = s.start;
      v.num_scheduled_tokens = s.num_tokens;
      v.resumed_from_preemption = r->resumed;
      // The blocks added to its tables since the connector last saw it (all of them when it
      // is new or was preempted).
      const auto& tables = kv_->BlockTables(r->id);
      if (r->resumed || r->reported_blocks.size() != tables.size()) {
        r->reported_blocks.assign(tables.size(), 0);
      }
      r->resumed = false;
      v.new_block_ids.resize(tables.size());
      for (size_t g = 0; g < tables.size(); ++g) {
        const size_t from = std::min(r->reported_blocks[g], tables[g].size());
        v.new_block_ids[g].assign(tables[g].begin() + from, tables[g].end());
        r->reported_blocks[g] = tables[g].size();
      }
      view.scheduled.push_back(std::move(v));
    }
    view.preempted = out.preempted;
    view.finished.assign(finished.begin(), finished.end());
    auto begun = connector_->BeginStep(view);
    if (!begun.ok()) {
      // The schedule and the connector disagree: no transfer this step, the engine goes on.
      KVSTASH_LOG_ERROR("offload: {}", begun.status().ToString());
      return {};
    }
    return std::move(begun).value();
  }

  void EndStep() override {
    if (Status s = connector_->EndStep(); !s.ok()) {
      KVSTASH_LOG_WARN("offload: a store was not submitted: {}", s.ToString());
    }
  }
  std::unordered_map<JobId, bool> FinishLoads(std::span<const JobId> jobs) override {
    return connector_->FinishLoads(jobs);
  }
  void RequestFinished(RequestId id) override { connector_->RequestFinished(id); }
  void Drain() override { connector_->Drain(); }
  OffloadStats stats() const override {
    const connector::KvConnectorStats c = connector_->stats();
    OffloadStats s;
    s.bytes_loaded = c.bytes_loaded;
    s.bytes_stored = c.bytes_stored;
    s.blocks_loaded = c.blocks_loaded;
    s.blocks_stored = c.blocks_stored;
    s.blocks_load_failed = c.blocks_load_failed;
    s.client = c.client;
    s.live_nodes = c.live_nodes;
    return s;
  }

 private:
  std::unique_ptr<connector::KvConnector> connector_;
  const KvCacheManager* kv_;
};

// The connector's options for the engine of `context` (all but the nodes).
connector::KvConnectorOptions ConnectorOptionsOf(const OffloadContext& context) {
  connector::KvConnectorOptions c;
  for (const AttentionSpec& spec : context.layout->groups) {
    c.scheduler.groups.push_back(OffloadGroupOf(spec));
  }
  c.scheduler.hash_block_size = context.kv_cache->hash_block_size();
  c.scheduler.prefix_caching = context.prefix_caching;
  c.pool = {reinterpret_cast<std::byte*>(context.pool.data()), context.layout->page_bytes(),
            context.pool.size() / context.layout->page_floats};
  c.fingerprint = context.fingerprint;
  c.pages_to_host = context.pages_to_host;
  c.pages_to_device = context.pages_to_device;
  return c;
}

}  // namespace

KvOffloadFactory NodeOffload(connector::NodeClientOptions client) {
  return [client](const OffloadContext& context) -> Result<std::unique_ptr<KvOffload>> {
    connector::KvConnectorOptions c = ConnectorOptionsOf(context);
    c.client = client;
    KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<connector::KvConnector> connector,
                             connector::KvConnector::Create(std::move(c)));
    return std::unique_ptr<KvOffload>(
        std::make_unique<NodeKvOffload>(std::move(connector), context.kv_cache));
  };
}

KvOffloadFactory NodeOffload(ConnectorPartsFactory make_parts) {
  return [make_parts = std::move(make_parts)](
             const OffloadContext& context) -> Result<std::unique_ptr<KvOffload>> {
    KVSTASH_ASSIGN_OR_RETURN(ConnectorParts parts, make_parts(context));
    KVSTASH_ASSIGN_OR_RETURN(
        std::unique_ptr<connector::KvConnector> connector,
        connector::KvConnector::Create(ConnectorOptionsOf(context), std::move(parts.client),
                                       std::move(parts.manager)));
    return std::unique_ptr<KvOffload>(
        std::make_unique<NodeKvOffload>(std::move(connector), context.kv_cache));
  };
}

}  // namespace kvstash::engine
