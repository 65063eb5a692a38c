defmodule EMLXAxon.TextGeneration.Serving.Scheduled do
  @moduledoc false
  # A serving built with :scheduler, without Nx: its executions only route
  # rows to a partition's EMLXAxon.Scheduler and return at once; each caller
  # then submits its own requests and waits for its own tokens in the
  # serving's client postprocessing (or, streaming, while it reads the
  # stream).
  #
  # Why the caller submits rather than the execution: the scheduler sends a
  # request's tokens to, and monitors, the process that submits it. An
  # execution runs in a task of the serving process that ends as soon as it
  # returns (its requests would be dropped with it), so it would need a
  # relay process living as long as its rows, one more hop per message, and
  # a way for callers to find and claim their rows. Nx.Serving runs the
  # client callbacks on the serving's node in the process that waits for the
  # result: the caller's own for a local call; for a caller on another node
  # (distributed batched_run), a process it spawns there, which sends the
  # final result, or each streamed item, back to the caller. That process
  # is the one the scheduler should message, and the one whose exit should
  # cancel the request: a remote caller's results travel home the way
  # Nx.Serving already sends them, as plain terms.

  alias EMLXAxon.TextGeneration.{Output, Scheduled}
  alias EMLXAxon.TextGeneration.Serving.Events

  @doc "The scheduler of `partition`: partitions take the schedulers in turn."
  @spec scheduler(EMLXAxon.Scheduler.server() | [EMLXAxon.Scheduler.server()], non_neg_integer()) ::
          EMLXAxon.Scheduler.server()
  def scheduler([_ | _] = schedulers, partition),
    do: Enum.at(schedulers, rem(partition, length(schedulers)))

  def scheduler(scheduler, _partition), do: scheduler

  @doc """
  Runs `requests` through `scheduler` in the calling process and returns
  their outputs, as `run/4` with `scheduler:` does.
  """
  @spec run!(EMLXAxon.Scheduler.server(), EMLXAxon.Qwen3.Model.State.t(), [map()], map()) ::
          [map()]
  def run!(scheduler, state, requests, opts) do
    run!(scheduler, state, requests, opts, nil)
  end

  defp run!(scheduler, state, requests, opts, emit) do
    Scheduled.check!(scheduler, state, requests, opts)

    scheduler
    |> Scheduled.run!(requests, opts, emit)
    |> Enum.map(&Output.put_tool_calls(&1, opts.tools))
  end

  @doc """
  A lazy stream of `request`'s text as it arrives from `scheduler`, ending
  with `{:done, output}` when `opts.stream_done` (see
  `EMLXAxon.TextGeneration.Serving.Events`). Nothing is submitted until
  the stream is read; it must be read by one process, and halting it early
  cancels the request.
  """
  @spec stream(EMLXAxon.Scheduler.server(), EMLXAxon.Qwen3.Model.State.t(), map(), map()) ::
          Enumerable.t()
  def stream(scheduler, state, request, opts) do
    Stream.resource(
      fn -> start(scheduler, state, request, opts) end,
      fn
        {:running, _pid, ref} = acc ->
          receive do
            {^ref, {:text, text}} -> {[text], acc}
            {^ref, {:done, output}} -> {Events.items({:done, output}, opts.stream_done), :done}
            {^ref, {:raise, kind, reason, stack}} -> :erlang.raise(kind, reason, stack)
          end

        :done ->
          {:halt, :done}
      end,
      &stop/1
    )
  end

  # Scheduled.run! gathers a request's tokens by blocking until its end;
  # a linked process runs it and hands each piece over as it comes, so the
  # stream gives text as soon as it exists. The scheduler sees that process
  # as the caller: it exits with the reader (the link), and the scheduler
  # then drops the request.
  defp start(scheduler, state, request, opts) do
    owner = self()
    ref = make_ref()

    pid =
      spawn_link(fn ->
        emit = fn {0, text} -> send(owner, {ref, {:text, text}}) end

        result =
          try do
            [output] = run!(scheduler, state, [request], opts, emit)
            {:done, output}
          catch
            kind, reason -> {:raise, kind, reason, __STACKTRACE__}
          end

        send(owner, {ref, result})
      end)

    {:running, pid, ref}
  end

  defp stop({:running, pid, ref}) do
    Process.unlink(pid)
    Process.exit(pid, :kill)
    flush(ref)
  end

  defp stop(:done), do: :ok

  defp flush(ref) do
    receive do
      {^ref, _} -> flush(ref)
    after
      0 -> :ok
    end
  end
end
